"""A contributor's fast-tier environment (`pip install -e ".[dev]"`) lacks what only some tests need (Ray,
the browser driver, the quantization backends): those tests skip there, through pytest.importorskip. CI
installs everything (`.[test]`) and sets DVLLM_REQUIRE_EXTRAS=1, and then a test skipped for a missing
package fails instead: a broken install cannot pass as a green run with tests quietly missing."""
from __future__ import annotations

import os

import pytest

_MISSING = "could not import"  # the reason pytest.importorskip gives


def _required() -> bool:
    return os.environ.get("DVLLM_REQUIRE_EXTRAS") == "1"


def _fail_if_missing_package(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or not _required():
        return
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if _MISSING in str(reason):
        report.outcome = "failed"
        report.longrepr = f"DVLLM_REQUIRE_EXTRAS=1 but a package this test needs is missing: {reason}"


class ExtrasGuard:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        _fail_if_missing_package(outcome.get_result())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        outcome = yield
        _fail_if_missing_package(outcome.get_result())


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(ExtrasGuard(), "dvllm-extras-guard")
