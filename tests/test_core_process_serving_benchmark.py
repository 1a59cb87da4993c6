"""dvllm.benchmarks.core_process_serving: end to end, tiny (two real servers of the tiny-sd preset, the engine
core on a thread of the server's process and in a process of its own, a few streaming clients each), and its
pure helpers (the step-time histogram read from /metrics, the runs combined, the ratios)."""
from __future__ import annotations

import json
import math

import pytest

from dvllm.benchmarks import core_process_serving
from dvllm.benchmarks.server_usage import histogram_delta, histogram_quantile, histogram_totals, server_usage
from dvllm.benchmarks.server_pair import run_order

# As tests/test_stages_serving_benchmark.py: one request per forward (its CFG rows fill the batch) and one image
# per decode, so the images' float noise does not depend on which requests shared a batch: pixel-equal runs.
SERVER_ARGS = "--device cpu --dtype float32 --state-pool-mb 32 --max-batch-size 2 --max-decode-batch 1"


@pytest.mark.slow
def test_core_process_serving_benchmark_end_to_end(tmp_path):
    out = tmp_path / "core.json"
    # No warm-up: the scrape before the run reads fresh servers' /metrics (a core process's server answers it
    # from its start).
    rc = core_process_serving.main(["--model", "tiny-sd", "--num-requests", "3", "--concurrency", "2",
                                    "--steps", "3", "--size", "16x16", "--partial-images", "1", "--rounds", "1",
                                    "--warmup", "0", "--server-args", SERVER_ARGS, "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert list(settings) == ["in-process", "process"]
    for summary in settings.values():
        assert (summary["completed"], summary["failed"], summary["runs"]) == (3, 0, 1)
        assert summary["images_per_s"] > 0
        # The step figures came from each server's /metrics: 3 requests x 3 steps, one request per step.
        assert summary["steps"] == 9
        assert summary["rows_per_step"] == 2.0
        assert 0 < summary["step_time_mean_s"] < 60 and 0 < summary["step_time_p95_s"] < 60
        assert 0 < summary["busy_share"] <= 1.0
        assert summary["step_time_mean_s_per_run"] == [pytest.approx(summary["step_time_mean_s"])]
        assert summary["images_per_s_per_run"] == [pytest.approx(summary["images_per_s"])]
    ratios = result["ratios_process_in_process"]
    assert set(ratios) == set(core_process_serving.RATIO_KEYS)
    for key in ("step_time_mean_s", "step_time_p95_s", "busy_share", "images_per_s", "latency_p95_s"):
        assert ratios[key] == pytest.approx(settings["process"][key] / settings["in-process"][key]), key
    requests = result["requests"]
    assert sorted((r["setting"], r["index"]) for r in requests) == [(s, i) for s in ("in-process", "process")
                                                                     for i in range(3)]
    for r in requests:
        assert r["ok"] and r["error"] is None and r["partials"] == 1, r
        assert 0 < r["ttfs"] <= r["first_partial"] <= r["latency"], r
    assert result["images"]["images_equal"] and result["images"]["requests_pixel_equal"] == 3


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--concurrency", "0"], ["--rounds", "0"],
                                  ["--steps", "2", "--partial-images", "2"], ["--size", "64"], ["--warmup", "-1"],
                                  ["--server-args=--no-engine-core-process"],
                                  ["--server-args", "--max-batch-size 4 --engine-core-process"]])
def test_core_process_serving_refuses_bad_arguments(argv):
    args = core_process_serving.build_parser().parse_args(argv)
    with pytest.raises(ValueError):
        core_process_serving.check_args(args)


def test_warmup_defaults_to_the_concurrency():
    args = core_process_serving.build_parser().parse_args(["--concurrency", "5"])
    core_process_serving.check_args(args)
    assert args.warmup == 5


def test_run_order_alternates_the_settings():
    assert run_order(("in-process", "process"), 2) == [("in-process", 0), ("process", 0), ("process", 1),
                                                       ("in-process", 1)]
    assert run_order(("off", "on"), 3)[4:] == [("off", 2), ("on", 2)]


def _scrape(observations: list[float], rows: int = 2) -> str:
    """A real server's /metrics text after these steps (each with `rows` rows)."""
    from dvllm.engine.engine import StepStats
    from dvllm.entrypoints.metrics import ServerMetrics

    stats = {"num_running": 0, "num_waiting": 0, "pool_used_blocks": 0, "pool_cached_blocks": 0,
             "pool_total_blocks": 0, "prompt_cache_hits": 0, "prompt_cache_queries": 0, "num_workers": 1,
             "num_workers_alive": 1, "loras_resident": 0, "num_preemptions": 0, "cache_skipped_rows": 0,
             "cache_computed_rows": 0, "lora_slot_loads": 0}
    metrics = ServerMetrics(lambda: stats, lambda: 0)
    for seconds in observations:
        metrics.on_step(StepStats(rows, 1, seconds), [])
    return metrics.render().decode()


def test_histogram_totals_reads_the_step_time_histogram():
    total, count, buckets = histogram_totals(_scrape([0.03, 0.2, 0.2]), "dvllm_step_time_seconds")
    assert (total, count) == (pytest.approx(0.43), 3.0)
    assert buckets[-1] == (math.inf, 3.0)
    assert dict(buckets)[0.025] == 0.0 and dict(buckets)[0.05] == 1.0 and dict(buckets)[0.25] == 3.0
    assert [upper for upper, _ in buckets] == sorted(upper for upper, _ in buckets)
    assert histogram_totals("dvllm_other_sum 1\n", "dvllm_step_time_seconds") is None


def test_histogram_quantile_interpolates_within_a_bucket():
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)        # the 10th of 20: the top of (0.1, 0.5]
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * 9 / 10)
    assert histogram_quantile(0.25, [(1.0, 4.0), (math.inf, 4.0)]) == pytest.approx(0.25)  # from 0 in the first
    assert histogram_quantile(0.95, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # in +Inf: the last finite bound
    assert histogram_quantile(0.95, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.95, []) is None


def test_server_usage_step_time_is_what_happened_between_the_scrapes():
    before = _scrape([4.0])  # a slow step before the run: not the run's
    after = _scrape([4.0, 0.2, 0.2, 0.3, 0.3], rows=2)
    delta = histogram_delta(before, after, "dvllm_step_time_seconds")
    assert delta["count"] == 4 and delta["sum"] == pytest.approx(1.0)
    steps = server_usage(before, after, duration=2.0)["step_time"]
    assert steps["steps"] == 4 and steps["seconds"] == pytest.approx(1.0)
    assert steps["mean_s"] == pytest.approx(0.25) and steps["rows_per_step"] == pytest.approx(2.0)
    assert steps["busy_share"] == pytest.approx(0.5)
    assert 0.25 < steps["p95_s"] <= 0.5  # all four in (0.1, 0.25] or (0.25, 0.5]; the 4.0 s step is not counted
    assert server_usage(None, after, 2.0)["step_time"] is None


def test_step_summary_combines_the_runs():
    a = server_usage(_scrape([]), _scrape([0.2, 0.2], rows=2), duration=1.0)
    b = server_usage(_scrape([]), _scrape([0.4, 0.4], rows=4), duration=3.0)
    s = core_process_serving.step_summary([(1.0, a), (3.0, b)])
    assert s["steps"] == 4
    assert s["step_time_mean_s"] == pytest.approx(0.3)
    assert s["rows_per_step"] == pytest.approx(3.0)
    assert s["busy_share"] == pytest.approx(1.2 / 4.0)
    assert s["step_time_mean_s_per_run"] == [pytest.approx(0.2), pytest.approx(0.4)]
    assert 0.25 < s["step_time_p95_s"] <= 0.5  # the summed buckets: the 0.4 s steps are the top 50%
    missing = core_process_serving.step_summary([(1.0, a), (1.0, server_usage(None, None, 1.0))])
    assert missing["step_time_mean_s"] is None and missing["step_time_mean_s_per_run"] == [pytest.approx(0.2), None]


def test_ratios_are_process_over_in_process():
    settings = {"in-process": {"step_time_mean_s": 0.5, "images_per_s": 2.0, "latency_p95_s": None},
                "process": {"step_time_mean_s": 0.25, "images_per_s": 3.0, "latency_p95_s": 1.0}}
    r = core_process_serving.ratios(settings)
    assert r["step_time_mean_s"] == pytest.approx(0.5) and r["images_per_s"] == pytest.approx(1.5)
    assert r["latency_p95_s"] is None and r["busy_share"] is None


def test_per_run_throughput_counts_each_rounds_completed_requests():
    from dvllm.benchmarks.server_pair import Record

    def record(round_: int, ok: bool) -> Record:
        return Record("process", round_, 0, 0.0, 0.0, ok, None if ok else "x", None, None, None)

    records = [record(0, True), record(0, True), record(0, False), record(1, True)]
    assert core_process_serving.per_run_throughput(records, [(2.0, {}), (0.5, {})]) == [1.0, 2.0]
    assert core_process_serving.per_run_throughput([], [(0.0, {})]) == [None]
