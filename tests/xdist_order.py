"""How the suite shares the machine's cores under pytest-xdist (the README's `pytest -n 2 --dist loadgroup`).

Each test file is one group and runs on one worker, as with `--dist loadfile`: a module's shared server, core
process, group or Ray runtime is started once, not once per worker. A file too long for one worker says so with
`XDIST_SPLIT = n` (a module global): its tests are dealt into n groups, each with its own module fixtures, so the
workers share it (the combination matrix). Under xdist the groups run longest first (the longest-processing-
time rule), by the per-file times recorded in tests/durations.json; a file not recorded there counts as short.
`DVLLM_WRITE_DURATIONS=tests/durations.json pytest -n 2 --dist loadgroup` records them again. A serial run
keeps the files' own order.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def recorded_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _group(item: pytest.Item, index_in_file: int) -> str:
    path = item.nodeid.split("::")[0]
    split = getattr(item.module, "XDIST_SPLIT", 1) if isinstance(item, pytest.Function) else 1
    return path if split <= 1 else f"{path}#{index_in_file % split}"


class XdistOrder:
    @pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marks into the groups it deals out
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        seen: dict[str, int] = defaultdict(int)
        groups: dict[str, list[pytest.Item]] = {}
        for item in items:
            path = item.nodeid.split("::")[0]
            group = _group(item, seen[path])
            seen[path] += 1
            item.add_marker(pytest.mark.xdist_group(name=group))
            groups.setdefault(group, []).append(item)
        recorded = recorded_durations()

        def expected(group: str) -> float:
            path = group.split("#")[0]
            parts = sum(1 for g in groups if g.split("#")[0] == path)
            return recorded.get(path, 0.0) / parts

        ordered = sorted(groups, key=lambda g: -expected(g))  # stable: unrecorded files keep their order
        items[:] = [item for group in ordered for item in groups[group]]


def register(config: pytest.Config) -> None:
    """Only on xdist's workers (they collect and run; the controller deals their groups out in this order)."""
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(XdistOrder(), "dvllm-xdist-order")
