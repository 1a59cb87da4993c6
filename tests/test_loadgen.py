"""`dvllm bench loadgen`: MLPerf LoadGen drives an AsyncDiffusionEngine through Offline, Server (Poisson arrivals,
a p99 bound) and SingleStream, and each short CPU run's summary says VALID; a failing request is counted and
makes the run fail without LoadGen waiting on it; settings and captions are checked."""
from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from utils_cli import restore_logging  # noqa: F401 (autouse: main() sets the process's logging; put back)

from dvllm.benchmarks.captions import MIN_WORDS, captions
from dvllm.benchmarks.loadgen import EngineSUT, Request, Settings, run_scenario


def test_captions_have_cocos_lengths_and_follow_their_seed():
    made = captions(5000)
    words = [len(c.split()) for c in made]
    assert min(words) >= MIN_WORDS and 10.0 <= statistics.mean(words) <= 11.5 and max(words) <= 25
    assert len(set(made)) > 2500  # a varied set, not a few sentences repeated
    assert captions(5000) == made and captions(50, seed=1) != made[:50]
    with pytest.raises(ValueError, match="count must be at least 1"):
        captions(0)


@pytest.mark.parametrize("changes, message", [
    ({"scenario": "MultiStream"}, "scenario must be one of"),
    ({"min_duration_s": 0}, "min_duration_s must be positive"),
    ({"server_target_qps": -1}, "server_target_qps must be positive"),
    ({"server_latency_percentile": 1.0}, r"server_latency_percentile must be in \(0, 1\)"),
    ({"min_query_count": 0}, "min_query_count must be at least 1"),
])
def test_settings_are_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        Settings(**{"scenario": "Offline", "min_duration_s": 1.0, **changes})


def test_scenarios_are_named_alone_in_a_list_or_all():
    import argparse

    from dvllm.benchmarks.loadgen import add_arguments, scenario_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = lambda flag: [s.scenario for s in scenario_settings(parser.parse_args(["--scenario", flag]))]  # noqa: E731
    assert names("Server") == ["Server"] and names("Offline, Server") == ["Offline", "Server"]
    assert names("all") == ["Offline", "Server", "SingleStream"]
    with pytest.raises(ValueError, match="names a scenario twice"):
        names("Server,Server")
    with pytest.raises(ValueError, match="scenario must be one of"):
        names("Offline,Multi")


class _FailingEngine:
    """An engine whose odd samples fail (an error output) and whose samples of index 2 raise."""

    def start(self) -> None:
        pass

    async def generate(self, prompt, params, request_id):
        await asyncio.sleep(0.001)
        if params.seed == 2:
            raise RuntimeError("the engine broke")
        yield SimpleNamespace(finished=True, error="refused" if params.seed % 2 else None)

    async def shutdown(self, grace_seconds: float) -> None:
        pass


def test_failed_requests_are_counted_and_loadgen_still_hears_of_each(tmp_path):
    pytest.importorskip("mlperf_loadgen")  # `.[test]`
    sut = EngineSUT(_FailingEngine(), Request("16x16", 2, 1.0, None, captions(8)))
    try:
        result = run_scenario(sut, Settings("Offline", min_duration_s=0.1, min_query_count=8), tmp_path)
    finally:
        sut.close()
    assert result["samples"] >= 8 and result["errors"] >= 5  # 1, 2, 3, 5, 7 of every 8 (LoadGen may send more)
    assert result["valid"] is False  # LoadGen's VALID alone does not make a run with failed requests valid
    assert result["first_error"] in ("refused", "RuntimeError: the engine broke")


@pytest.mark.slow
def test_the_three_scenarios_run_valid_on_the_cpu(sd_eps_path, tmp_path, capsys):
    pytest.importorskip("mlperf_loadgen")
    from dvllm.entrypoints.cli import main

    out = tmp_path / "loadgen.json"
    # Server: enough queries for LoadGen's early stopping at p99 (459 at least, every one under the bound)
    code = main(["bench", "loadgen", "--model", sd_eps_path, "--device", "cpu", "--dtype", "float32",
                 "--size", "16x16", "--steps", "2", "--num-samples", "64", "--scenario", "all",
                 "--min-duration-s", "1", "--min-query-count", "64", "--server-min-query-count", "480",
                 "--offline-expected-qps", "300",
                 "--server-target-qps", "80", "--server-target-latency-s", "10",
                 # SingleStream issues min-duration / expected-latency queries: a guess under the real latency
                 # (15 ms and more here) keeps the run over its minimum duration however fast the machine is
                 "--single-stream-expected-latency-s", "0.005", "--output-dir", str(tmp_path / "logs"),
                 "--output-json", str(out), "--max-num-waiting", "4096"])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, printed
    assert [r["scenario"] for r in result["scenarios"]] == ["Offline", "Server", "SingleStream"]
    for r in result["scenarios"]:
        assert r["valid"] and r["errors"] == 0 and r["samples"] >= 64, r
        assert "Result is : VALID" in Path(r["summary"]).read_text()
    offline, server, single = result["scenarios"]
    assert offline["samples_per_s"] > 0 and server["p99_latency_s"] <= 10 and single["p90_latency_s"] > 0
    assert "unofficial" in result["note"] and "VALID" in printed
