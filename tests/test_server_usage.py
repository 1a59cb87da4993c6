"""benchmarks/server_usage.py: what a server's /metrics says about a run (the step-time histogram read, the
difference between two scrapes), on a real server's metrics text."""
from __future__ import annotations

import math

import pytest

from dvllm.benchmarks.server_usage import histogram_delta, histogram_quantile, histogram_totals, server_usage


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
