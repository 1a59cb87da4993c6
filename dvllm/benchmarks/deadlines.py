"""Deadlines on a mixed workload: SLO attainment of static degree 1 (one worker on every core; and N data-parallel
Ray workers of one core each, as on N GPUs), a static group of N (sequence parallel, every forward split by
tokens) and an elastic group of N (group_policy="elastic": each step's split as its rows pay, late requests
ahead), in one run, on the same machine's cores.

The workload mixes small requests (few steps, a small size) and big ones (more steps, a large size), arriving at
seeded Poisson times. Each request's deadline is `--slack` times its class's latency alone on the one worker (the
calibration at the start), so the deadlines are the same for all. The one worker runs `--degree` torch threads
(every core); a Ray worker and a group's process run one thread each (one core each): the same compute for all.
Each engine serves the trace alone, one after the other (a process leads one group at a time), `--rounds` times
in turn.

    python -m dvllm.benchmarks.deadlines --model flux-cpu --small 512 --big 1024 --requests 16
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import torch

from dvllm.benchmarks.report import emit_json
from dvllm.benchmarks.throughput import _machine
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.sampling_params import SamplingParams

# static 1: one worker on every core; data parallel: `--degree` Ray workers of one core each, requests placed on
# them (static degree 1 as on N GPUs); static and elastic: a group of `--degree` processes of one core each
POLICIES = ("static 1", "data parallel", "static group", "elastic group")


def _params(args: argparse.Namespace, big: bool, seed: int, deadline_s: float | None) -> SamplingParams:
    side = args.big if big else args.small
    return SamplingParams(num_inference_steps=args.big_steps if big else args.small_steps, seed=seed, height=side,
                          width=side, output_type="np", output_kind="final", deadline_s=deadline_s)


def _engine_args(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    common = dict(model=args.model, load_format=args.load_format, device="cpu", dtype=args.dtype,
                  engine_core_process=False)
    if policy == "static 1":
        return common
    if policy == "data parallel":
        return {**common, "executor": "ray", "num_workers": args.degree, "worker_num_cpus": 1}
    return {**common, "sequence_parallel_size": args.degree,
            "group_policy": "elastic" if policy.startswith("elastic") else "static"}


def _trace(args: argparse.Namespace, solo: dict[bool, float]) -> list[tuple[float, bool]]:
    """(arrival offset, big) per request: Poisson arrivals at `--load` times what one worker serves alone."""
    rng = random.Random(args.seed)
    bigs = round(args.requests * args.big_share)
    kinds = [True] * bigs + [False] * (args.requests - bigs)
    rng.shuffle(kinds)
    mean_service = statistics.fmean(solo[big] for big in kinds)
    rate = args.load / mean_service
    offsets, t = [], 0.0
    for _ in kinds:
        offsets.append(t)
        t += rng.expovariate(rate)
    return list(zip(offsets, kinds))


async def _one(engine: AsyncDiffusionEngine, prompt: str, params: SamplingParams, start: float,
               offset: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    sent = time.perf_counter()
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    if final.error is not None:
        raise RuntimeError(final.error)
    return {"latency": time.perf_counter() - sent, "met": final.metrics.deadline_met}


async def _serve(args: argparse.Namespace, policy: str, solo: dict[bool, float] | None) -> dict[str, Any]:
    torch.set_num_threads(args.degree if policy == "static 1" else 1)
    engine = AsyncDiffusionEngine(**_engine_args(args, policy))
    engine.start()
    try:
        if solo is None:  # the calibration: each class alone on the one worker (after a warm-up each)
            solo = {}
            for big in (False, True):
                await _one(engine, "a warm-up", _params(args, big, 0, None), time.perf_counter(), 0.0)
                solo[big] = (await _one(engine, "alone", _params(args, big, 0, None), time.perf_counter(),
                                        0.0))["latency"]
        else:
            for big in (False, True):
                await _one(engine, "a warm-up", _params(args, big, 0, None), time.perf_counter(), 0.0)
        trace = _trace(args, solo)
        start = time.perf_counter()
        results = await asyncio.gather(*[
            _one(engine, f"request {i}", _params(args, big, i, args.slack * solo[big]), start, offset)
            for i, (offset, big) in enumerate(trace)])
        # (the engine runs in this process: engine_core_process off)
        group = getattr(getattr(engine.engine.executor, "worker", None), "group", None)
        forwards = None if group is None else dict(group.forwards)
        late_steps = engine.stats().get("late_steps", 0)
    finally:
        await engine.shutdown()
    by_class = {}
    for name, big in (("small", False), ("big", True)):
        mine = [r for r, (_, b) in zip(results, trace) if b == big]
        if mine:
            latencies = sorted(r["latency"] for r in mine)
            by_class[name] = {"requests": len(mine), "met": sum(bool(r["met"]) for r in mine),
                              "p50_s": round(statistics.median(latencies), 3),
                              "p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3)}
    return {"attainment": round(sum(bool(r["met"]) for r in results) / len(results), 3), "classes": by_class,
            "group_forwards": forwards, "late_steps": late_steps, "solo_s": solo}


def run(args: argparse.Namespace) -> dict[str, Any]:
    policies = [p.strip() for p in args.policies.split(",")]
    if policies[0] != "static 1" or not set(policies) <= set(POLICIES):
        raise ValueError(f"--policies: 'static 1' first (it calibrates the deadlines), then any of {POLICIES[1:]}")
    solo: dict[bool, float] | None = None
    rounds: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    if "data parallel" in policies:
        import ray

        ray.init(num_cpus=args.degree, include_dashboard=False, logging_level="warning")
    try:
        for _ in range(args.rounds):
            for policy in policies:
                result = asyncio.run(_serve(args, policy, solo))
                solo = result.pop("solo_s")
                rounds[policy].append(result)
    finally:
        if "data parallel" in policies:
            ray.shutdown()
    torch.set_num_threads(args.degree)  # the label names the one worker's threads; the others run one each
    machine = _machine(torch.device("cpu"), getattr(torch, args.dtype)) + ", one thread a Ray worker or group process"
    return {
        "model": args.model, "small": f"{args.small}x{args.small}, {args.small_steps} steps",
        "big": f"{args.big}x{args.big}, {args.big_steps} steps", "requests": args.requests,
        "big_share": args.big_share, "load": args.load, "slack": args.slack, "degree": args.degree,
        "solo_s": {"small": round(solo[False], 3), "big": round(solo[True], 3)},
        "deadline_s": {"small": round(args.slack * solo[False], 3), "big": round(args.slack * solo[True], 3)},
        "machine": machine, "rounds": rounds,
        "median_attainment": {policy: statistics.median(r["attainment"] for r in runs)
                              for policy, runs in rounds.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-cpu")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--small", type=int, default=512, help="a small request's side, pixels")
    parser.add_argument("--big", type=int, default=1024, help="a big request's side, pixels")
    parser.add_argument("--small-steps", type=int, default=4)
    parser.add_argument("--big-steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--big-share", type=float, default=0.25, help="share of big requests")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate, as a share of what one worker "
                        "serves alone")
    parser.add_argument("--slack", type=float, default=2.0, help="deadline: this times the class's latency alone")
    parser.add_argument("--degree", type=int, default=2, help="the group's size, and the one worker's threads")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, 'static 1' first: " + ", ".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
