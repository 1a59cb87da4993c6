"""A pairwise covering array: rows of factor values in which every allowed pair of values of two factors appears
together at least once (not the full product). Greedy, in the AETG manner, and deterministic: each row starts
from an uncovered pair and takes, factor by factor, the value that covers the most pairs still uncovered; ties
go to the cheaper value, so costly values (a process to start) gather in few rows. Pairs a row may not hold
(`forbidden`) are left out: the caller covers them another way (a refusal at start, say)."""
from __future__ import annotations

import itertools
import random
from typing import Any, Callable

Value = tuple[str, Any]  # (factor, value)
Pair = frozenset  # of two Values


def all_pairs(factors: dict[str, list[Any]]) -> set[Pair]:
    names = list(factors)
    return {frozenset(((a, x), (b, y))) for a, b in itertools.combinations(names, 2)
            for x in factors[a] for y in factors[b]}


def pairs_of(row: dict[str, Any]) -> set[Pair]:
    return {frozenset(p) for p in itertools.combinations(row.items(), 2)}


def covering_rows(factors: dict[str, list[Any]], forbidden: Callable[[Pair], bool],
                  cost: Callable[[Value], float] = lambda value: 0.0, candidates: int = 12,
                  seed: int = 0) -> list[dict[str, Any]]:
    """Rows (factor -> value, in the factors' order) that together hold every pair `forbidden` allows, and no
    pair it forbids."""
    rng = random.Random(seed)
    names = list(factors)
    uncovered = {p for p in all_pairs(factors) if not forbidden(p)}
    rows: list[dict[str, Any]] = []
    while uncovered:
        best, best_gain = None, -1.0
        for _ in range(candidates):
            row = _candidate(names, factors, uncovered, forbidden, cost, rng)
            if row is None:
                continue
            gain = len(pairs_of(row) & uncovered) - 1e-3 * sum(cost(v) for v in row.items())
            if gain > best_gain:
                best, best_gain = row, gain
        if best is None or not pairs_of(best) & uncovered:
            raise ValueError(f"no row can hold the pairs left: {sorted(map(sorted, uncovered))[:3]} ...")
        rows.append(best)
        uncovered -= pairs_of(best)
    return rows


def _candidate(names: list[str], factors: dict[str, list[Any]], uncovered: set[Pair],
               forbidden: Callable[[Pair], bool], cost: Callable[[Value], float],
               rng: random.Random) -> dict[str, Any] | None:
    # (sorted by a key of the values themselves: a frozenset's repr follows string hashes, which differ per process)
    ordered = sorted(uncovered, key=lambda p: sorted((names.index(f), repr(v)) for f, v in p))
    seed_pair = sorted(rng.choice(ordered), key=lambda v: names.index(v[0]))
    row = dict(seed_pair)
    rest = [n for n in names if n not in row]
    rng.shuffle(rest)
    for name in rest:
        choices = []
        for value in factors[name]:
            new = [frozenset(((name, value), item)) for item in row.items()]
            if any(forbidden(p) for p in new):
                continue
            choices.append((-sum(p in uncovered for p in new), cost((name, value)), rng.random(), value))
        if not choices:
            return None
        row[name] = min(choices)[3]
    return {n: row[n] for n in names}
