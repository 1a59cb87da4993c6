"""What a server's /metrics say happened during a benchmark run: two scrapes, before and after, compared."""
from __future__ import annotations

import re
from typing import Any

_STAGE_LINE = re.compile(r'^dvllm_stage_(busy_seconds|items)_total\{stage="(\w+)"\} (\S+)$')


def queue_time_totals(metrics_text: str) -> tuple[float, float] | None:
    """(sum, count) of dvllm_request_queue_time_seconds in a Prometheus scrape, or None if absent."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("dvllm_request_queue_time_seconds_sum", "dvllm_request_queue_time_seconds_count"):
            found[name.rsplit("_", 1)[1]] = float(value)
    if len(found) != 2:
        return None
    return found["sum"], found["count"]


def stage_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """{stage: (busy seconds, items)} from the dvllm_stage_* counters of a scrape; {} if it has none."""
    found: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = _STAGE_LINE.match(line)
        if match:
            kind, stage, value = match.groups()
            found.setdefault(stage, {})[kind] = float(value)
    return {stage: (v.get("busy_seconds", 0.0), v.get("items", 0.0)) for stage, v in found.items()}


def histogram_totals(metrics_text: str, name: str) -> tuple[float, float, list[tuple[float, float]]] | None:
    """(sum, count, [(upper bound, cumulative count), ...] in bound order, +Inf last) of a Prometheus
    histogram in a scrape, or None if absent."""
    total = count = None
    buckets: list[tuple[float, float]] = []
    bucket = f'{name}_bucket{{le="'
    for line in metrics_text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == f"{name}_sum":
            total = float(value)
        elif key == f"{name}_count":
            count = float(value)
        elif key.startswith(bucket) and key.endswith('"}'):
            buckets.append((float(key[len(bucket):-2]), float(value)))  # float() reads "+Inf"
    if total is None or count is None:
        return None
    return total, count, sorted(buckets)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of cumulative buckets, as Prometheus's histogram_quantile estimates it: linear
    within the bucket it falls in (from 0 for the first), the last finite bound if it falls in +Inf; None
    without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank and cumulative > below:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def histogram_delta(before: str, after: str, name: str) -> dict[str, Any] | None:
    """What a histogram observed between two scrapes: sum, count and the cumulative buckets' differences."""
    h0, h1 = histogram_totals(before, name), histogram_totals(after, name)
    if h0 is None or h1 is None:
        return None
    start = dict(h0[2])
    return {"sum": h1[0] - h0[0], "count": h1[1] - h0[1],
            "buckets": [(upper, cumulative - start.get(upper, 0.0)) for upper, cumulative in h1[2]]}


def _gauge(metrics_text: str, name: str) -> float | None:
    for line in metrics_text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return None


def server_usage(before: str | None, after: str | None, duration: float) -> dict[str, Any]:
    """The mean queue time of the requests that started in between; the engine's steps (those that ran
    rows) in between: how many, their seconds, mean, mean rows, P95 (estimated from the histogram's
    buckets), the buckets' counts, and the share of the run's wall time spent stepping; and per stage its occupancy (busy
    seconds per worker over the run's wall time), items and milliseconds per item. None and {} where the
    server's /metrics lack them."""
    usage: dict[str, Any] = {"queue_time_mean_s": None, "step_time": None, "stages": {}}
    if before is None or after is None:
        return usage
    q0, q1 = queue_time_totals(before), queue_time_totals(after)
    if q0 is not None and q1 is not None and q1[1] > q0[1]:
        usage["queue_time_mean_s"] = (q1[0] - q0[0]) / (q1[1] - q0[1])
    steps = histogram_delta(before, after, "dvllm_step_time_seconds")
    rows = histogram_delta(before, after, "dvllm_batch_rows")
    if steps is not None:
        usage["step_time"] = {
            "steps": int(steps["count"]), "seconds": steps["sum"],
            "mean_s": steps["sum"] / steps["count"] if steps["count"] > 0 else None,
            "rows_per_step": rows["sum"] / rows["count"] if rows is not None and rows["count"] > 0 else None,
            "p95_s": histogram_quantile(0.95, steps["buckets"]), "buckets": steps["buckets"],
            "busy_share": steps["sum"] / duration if duration > 0 else None,
        }
    workers = _gauge(after, "dvllm_num_workers") or 1.0
    s0 = stage_totals(before)
    for stage, (busy, items) in stage_totals(after).items():
        b0, i0 = s0.get(stage, (0.0, 0.0))
        busy, items = busy - b0, items - i0
        usage["stages"][stage] = {
            "occupancy": busy / duration / workers if duration > 0 else None,
            "items": int(items),
            "ms_per_item": 1000 * busy / items if items > 0 else None,
        }
    return usage


def format_stages(stages: dict[str, dict[str, Any]]) -> str:
    """One line: each stage that worked, with its occupancy and time per item."""
    parts = [f"{stage} {100 * s['occupancy']:.1f}% ({s['ms_per_item']:.1f} ms/item)"
             for stage, s in stages.items() if s["items"] and s["occupancy"] is not None]
    return " · ".join(parts) if parts else "n/a (the server's /metrics has no dvllm_stage_* counters)"
