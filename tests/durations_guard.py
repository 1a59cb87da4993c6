"""Keeps the suite's time from creeping back: every test's duration (setup, call and teardown together)
is printed at the end of the run, slowest first, with each file's total; and a test not marked `slow` that
takes longer than the fast tier's budget fails, saying so. The fast tier (`pytest -m "not slow"`) is the
edit-run loop and must stay within five minutes: a test that needs more belongs to the full suite.

The budget is wall-clock time on these 2-core machines, with room for a loaded machine (the fast tier's
tests take a few seconds at most); DVLLM_TEST_BUDGET_S changes it, 0 turns the guard off. Setup is counted:
the first test of a module pays for a server or process the module shares, and pays it in the fast tier too.
With pytest-xdist, each worker checks its own tests and the controller prints the table.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DEFAULT_BUDGET_S = 60.0
SHOWN_MIN_S = 0.5  # faster tests are counted in their file's total, not listed one by one


def _budget() -> float:
    raw = os.environ.get("DVLLM_TEST_BUDGET_S", "")
    try:
        return float(raw) if raw else DEFAULT_BUDGET_S
    except ValueError:
        raise pytest.UsageError(f"DVLLM_TEST_BUDGET_S must be a number of seconds, not {raw!r}") from None


class DurationsGuard:
    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.durations: dict[str, float] = defaultdict(float)
        self._phases: dict[str, float] = {}  # setup + call so far, per test running on this process

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        if call.when != "teardown":
            self._phases[item.nodeid] = self._phases.get(item.nodeid, 0.0) + report.duration
            return
        total = self._phases.pop(item.nodeid, 0.0) + report.duration
        if not report.passed or self.budget_s <= 0 or item.get_closest_marker("slow") is not None:
            return
        if total > self.budget_s:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {total:.1f} s, over the fast tier's budget of {self.budget_s:g} s "
                "(DVLLM_TEST_BUDGET_S): mark it @pytest.mark.slow, or make it faster (share the module's "
                "server or process; see tests/durations_guard.py)")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] += report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.durations:
            return
        write = terminalreporter.write_line
        per_file: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.durations.items():
            per_file[nodeid.split("::")[0].split("@")[0]] += seconds
        terminalreporter.section("durations (setup + call + teardown), slowest first")
        for nodeid, seconds in sorted(self.durations.items(), key=lambda kv: -kv[1]):
            if seconds >= SHOWN_MIN_S:
                write(f"{seconds:8.2f} s  {nodeid}")
        terminalreporter.section("durations per file")
        for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
            write(f"{seconds:8.1f} s  {path}")
        write(f"{sum(per_file.values()):8.1f} s  in all (summed over tests; workers run side by side)")
        out = os.environ.get("DVLLM_WRITE_DURATIONS")
        if out:  # the per-file times tests/xdist_order.py deals the files out by
            Path(out).write_text(json.dumps({k: round(v, 1) for k, v in sorted(per_file.items())}, indent=0) + "\n")


def register(config: pytest.Config) -> None:
    """Called from conftest.py's pytest_configure (on the controller and on each xdist worker)."""
    config.pluginmanager.register(DurationsGuard(_budget()), "dvllm-durations-guard")
