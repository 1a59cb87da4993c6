"""`dvllm bench serve`: the load generator against a real `dvllm serve` of the tiny saved pipeline; and plot.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from utils_server import RemoteServer
from utils_cli import restore_logging  # noqa: F401 (autouse: main() sets the process's logging; put back)

from dvllm.benchmarks.workloads import arrival_times, mix_workload, trace_workload
from dvllm.entrypoints.cli import main as dvllm_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
FAST = ["--size", "16x16", "--steps", "4", "--guidance", "7.5"]


@pytest.fixture(scope="module")
def server(sd_eps_path):
    with RemoteServer(sd_eps_path, ENGINE_ARGS) as dvllm:
        yield dvllm


def run_bench(url: str, out: str, *args: str) -> dict:
    assert dvllm_main(["bench", "serve", "--base-url", url, "--output-json", out, *args]) == 0
    with open(out) as f:
        return json.load(f)


def denoiser_rows(url: str) -> float:
    """Denoiser rows the server has run, summed over its steps (a CFG image is two rows a step): the work
    done, as the server counts it, not as the benchmark's records say."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("dvllm_batch_rows_sum ")))


def assert_duration_brackets_the_requests(summary: dict, records: list[dict], wall: float) -> None:
    """The timed window holds every send and answer, and lies within the time the test itself measured."""
    ends = [r["sent"] + r["latency"] for r in records if r["ok"]]
    assert all(r["sent"] >= 0 for r in records)
    assert 0 < max(ends) <= summary["duration_s"] <= wall


@pytest.mark.slow
def test_load_generator_against_dvllm(server, tmp_path):
    dvllm = server
    rows_before, start = denoiser_rows(dvllm.url), time.perf_counter()
    result = run_bench(dvllm.url, str(tmp_path / "fixed.json"), *FAST, "--num-requests", "6", "--request-rate",
                       "40", "--warmup", "1", "--label", "dvllm")
    wall = time.perf_counter() - start
    s, records = result["summary"], result["requests"]
    assert (s["num_requests"], s["completed"], s["failed"]) == (6, 6, 0), s["errors"]
    assert s["latency_p50_s"] <= s["latency_p95_s"] <= s["latency_p99_s"] <= s["latency_max_s"]
    assert_duration_brackets_the_requests(s, records, wall)
    # The server ran 4 steps x 2 CFG rows for each of the 6 timed requests and the warm-up one; the
    # reported steps/s is the timed requests' share of that work over the reported duration.
    rows = denoiser_rows(dvllm.url) - rows_before
    assert rows == (6 + 1) * 4 * 2
    assert s["steps_per_s"] == pytest.approx((rows - 1 * 4 * 2) / 2 / s["duration_s"])
    # dvllm's /metrics has the queue-time histogram; each request's queue time is part of its latency.
    assert 0 <= s["queue_time_mean_s"] <= s["latency_mean_s"]
    assert s["slo_attainment"] is None  # no SLO given: n/a, not invented
    # The stages' work in the timed window, as the server's /metrics count it: 6 requests encoded, their
    # rows denoised, 6 images decoded (in the loop or by the decode stage); the loop busy at most all along.
    stages = s["stages"]
    assert (stages["encode"]["items"], stages["denoise"]["items"]) == (6, 6 * 4 * 2)
    assert stages["decode"]["items"] + stages["decode_stage"]["items"] == 6
    loop = sum(stages[name]["occupancy"] for name in ("encode", "denoise", "decode"))
    assert 0 < stages["denoise"]["occupancy"] <= loop <= 1
    assert [r["index"] for r in records] == list(range(6)) and all(r["ok"] and r["steps"] == 4 for r in records)
    assert [r["arrival"] for r in records] == pytest.approx(arrival_times(6, 40.0, seed=0))
    assert result["label"] == "dvllm" and result["request_rate"] == 40.0


def test_trace_slo_and_failures(server, tmp_path):
    dvllm = server
    trace = tmp_path / "trace.jsonl"
    lines = [{"prompt": "a", "size": "16x16", "steps": 3, "guidance": 1.0, "sampler": "euler", "slo": 60,
              "deadline": 120},  # a trace's own field reaches the server (priority would need
             # --allow-client-priority there)
             {"prompt": "b", "size": "16x16", "steps": 2, "guidance": 7.5, "slo": 1e-6},  # cannot be met
             {"prompt": "c", "size": "15x15", "steps": 2}]  # not a multiple of 8: the server refuses it
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rows_before, start = denoiser_rows(dvllm.url), time.perf_counter()
    result = run_bench(dvllm.url, str(tmp_path / "trace.json"), "--workload", "trace", "--trace", str(trace),
                       "--warmup", "0", "--slo", "30")
    wall = time.perf_counter() - start
    s, records = result["summary"], result["requests"]
    assert (s["completed"], s["failed"]) == (2, 1)
    assert "HTTP 400" in s["errors"][0]
    assert [r["status"] for r in records] == [200, 200, 400] and records[2]["latency"] is None
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # the failed request counts as a miss
    assert_duration_brackets_the_requests(s, records, wall)
    # What the server denoised: "a" 3 steps x 1 row (guidance 1: no CFG), "b" 2 steps x 2 rows, "c" nothing.
    assert denoiser_rows(dvllm.url) - rows_before == 3 * 1 + 2 * 2
    # steps/s counts the completed requests' steps (3 + 2), not the refused one's.
    assert s["steps_per_s"] * s["duration_s"] == pytest.approx(3 + 2)


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(SystemExit) as e:
        dvllm_main(["bench", "serve", "--workload", "trace"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)


def test_mix_workload_is_seeded_and_varied():
    a = mix_workload(40, sizes=["16x16", "32x32"], steps=[10, 20], guidances=[1.0, 7.5], samplers=[None, "euler"])
    b = mix_workload(40, sizes=["16x16", "32x32"], steps=[10, 20], guidances=[1.0, 7.5], samplers=[None, "euler"])
    assert a == b
    assert {s.size for s in a} == {"16x16", "32x32"} and {s.guidance for s in a} == {1.0, 7.5}


def test_trace_arrivals_and_errors(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "late", "arrival": 2.0}\n\n{"prompt": "early", "arrival": 0.5, "steps": 7}\n')
    specs = trace_workload(str(trace), size="16x16", steps=20, guidance=7.5, sampler=None)
    assert [(s.prompt, s.arrival, s.steps) for s in specs] == [("early", 0.5, 7), ("late", 2.0, 20)]
    trace.write_text('{"prompt": "a"}\n{"prompt": "b", "stpes": 3}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: unknown key\(s\) \['stpes'\]"):
        trace_workload(str(trace), size="16x16", steps=20, guidance=7.5, sampler=None)
    gaps = np.diff(arrival_times(2000, 10.0, burstiness=0.5, seed=1))
    assert gaps.mean() == pytest.approx(0.1, rel=0.1) and gaps.std() > 0.1  # burstier than Poisson (std = mean)


def test_trace_lines_carry_loras_cache_priority_and_deadline(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"prompt": "a", "loras": {"style": 0.8, "ink": 1}, "cache": {"method": "first_block", "threshold": 0.1},
              "priority": -1, "deadline": 30},
             {"prompt": "b", "cache": None},  # no cache, whatever the server's default
             {"prompt": "c"}]  # nothing sent: the server's defaults
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    a, b, c = trace_workload(str(trace), size="16x16", steps=4, guidance=1.0, sampler=None)
    assert a.body()["loras"] == {"style": 0.8, "ink": 1.0} and a.body()["cache"]["method"] == "first_block"
    assert (a.body()["priority"], a.body()["deadline"]) == (-1, 30.0)
    assert "cache" in b.body() and b.body()["cache"] is None
    assert not {"loras", "cache", "priority", "deadline"} & set(c.body())
    assert json.loads(a.form()["loras"]) == {"style": 0.8, "ink": 1.0} and b.form()["cache"] == "null"
    for bad, message in (({"loras": ["style"]}, "loras must be an object"),
                         ({"loras": {"style": "x"}}, "could not convert"),
                         ({"cache": "first_block"}, "cache must be null or an object with a 'method'"),
                         ({"priority": 1.5}, "priority must be an integer"),
                         ({"priority": 1e999}, "priority must be an integer"),
                         ({"deadline": 0}, "deadline is seconds after arrival")):
        trace.write_text(json.dumps({"prompt": "x", **bad}) + "\n")
        with pytest.raises(ValueError, match=message):
            trace_workload(str(trace), size="16x16", steps=4, guidance=1.0, sampler=None)


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"num_requests": 3, "latencies": [0.5, 0.7, 2.0], "slo_shares": [0.4, 0.9, 1.6], "goodput_rps": 0.5,
               "slo_attainment": 2 / 3}
    runs = [{"rate": rate, "contenders": {"dvllm": [summary], "request": [dict(summary, goodput_rps=0.3)]}}
            for rate in (1.0, 2.0)]
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"model": "tiny-sd", "requests": 3, "slo_factor": 3.0, "runs": runs}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schedule": 0.001, "gather": 0.002, "forward": 0.05, "update_scatter": 0.003,
                                   "decode": 0.004, "bookkeeping": 0.0005, "note": "ignored"}))
    out = tmp_path / "figs"
    subprocess.run([sys.executable, "benchmarks/plot.py", str(result), "--profile", str(profile), "--output-dir",
                    str(out)], cwd=REPO, check=True, capture_output=True)
    for name in ("latency_cdf.png", "goodput_vs_load.png", "step_breakdown.png"):
        with Image.open(out / name) as image:
            assert image.width > 100 and image.height > 100
    bad = subprocess.run([sys.executable, "benchmarks/plot.py", str(profile), "--output-dir", str(out)], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a `dvllm bench run` result" in bad.stderr
