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


def _gauge(metrics_text: str, name: str) -> float | None:
    for line in metrics_text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return None


def server_usage(before: str | None, after: str | None, duration: float) -> dict[str, Any]:
    """The mean queue time of the requests that started in between, and per stage its occupancy (busy
    seconds per worker over the run's wall time), items and milliseconds per item; None and {} where the
    server's /metrics lack them."""
    usage: dict[str, Any] = {"queue_time_mean_s": None, "stages": {}}
    if before is None or after is None:
        return usage
    q0, q1 = queue_time_totals(before), queue_time_totals(after)
    if q0 is not None and q1 is not None and q1[1] > q0[1]:
        usage["queue_time_mean_s"] = (q1[0] - q0[0]) / (q1[1] - q0[1])
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
