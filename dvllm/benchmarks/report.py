"""Per-request records of a serving benchmark, and the summary, table and JSON made from them."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dvllm.benchmarks.server_usage import format_stages

MAX_ERRORS_SHOWN = 5


def emit_json(result: dict[str, Any], path: str | None) -> None:
    """A benchmark's result printed as JSON, and written to `path` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


@dataclass
class RequestRecord:
    index: int
    arrival: float           # scheduled send offset, seconds from the start
    sent: float | None       # actual send offset (later than arrival under --max-concurrency or client lag)
    latency: float | None    # send to complete answer, seconds; None if it failed
    ok: bool
    status: int | None       # HTTP status; None if no answer came
    error: str | None
    steps: int
    n: int
    size: str
    guidance: float
    sampler: str | None
    slo: float | None
    seeds: list[int] | None = None  # per image, as the server reported them

    @property
    def within_slo(self) -> bool:
        return self.ok and self.slo is not None and self.latency is not None and self.latency <= self.slo


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], duration: float, queue_time_mean: float | None,
              open_loop: bool = True, stages: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Throughputs count completed requests only; a failed request counts as an SLO miss. The send lag
    (how late the client sent against the schedule) means something only without a concurrency cap."""
    ok = [r for r in records if r.ok]
    latencies = [r.latency for r in ok]
    with_slo = [r for r in records if r.slo is not None]
    met = sum(r.within_slo for r in with_slo)
    errors: list[str] = []
    for r in records:
        if r.error and r.error not in errors and len(errors) < MAX_ERRORS_SHOWN:
            errors.append(r.error)
    lags = [r.sent - r.arrival for r in records if r.sent is not None and open_loop]
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "images_per_s": sum(r.n for r in ok) / duration if duration > 0 else None,
        "steps_per_s": sum(r.steps * r.n for r in ok) / duration if duration > 0 else None,
        "latency_mean_s": float(np.mean(latencies)) if latencies else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "latency_p99_s": percentile(latencies, 99),
        "latency_max_s": max(latencies) if latencies else None,
        "queue_time_mean_s": queue_time_mean,
        "slo_requests": len(with_slo),
        "slo_attainment": met / len(with_slo) if with_slo else None,
        "goodput_rps": met / duration if with_slo and duration > 0 else None,
        "max_send_lag_s": max(lags) if lags else None,
        "stages": stages or {},  # per stage: occupancy, items, ms per item (dvllm.benchmarks.server_usage)
    }



def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(label: str, workload: str, load: str, s: dict[str, Any]) -> str:
    lat = " / ".join(_fmt(s[f"latency_{k}_s"]) for k in ("mean", "p50", "p95", "p99"))
    queue = _fmt(s["queue_time_mean_s"]) if s["queue_time_mean_s"] is not None else \
        "n/a (the server's /metrics has no dvllm_request_queue_time_seconds)"
    slo = "n/a (no SLO: give --slo or 'slo' in the trace)" if s["slo_attainment"] is None else \
        f"{100 * s['slo_attainment']:.1f}% of {s['slo_requests']}"
    rows = [
        ("engine", label),
        ("workload", workload),
        ("load", load),
        ("completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", _fmt(s["duration_s"], 2)),
        ("requests/s", _fmt(s["requests_per_s"], 2)),
        ("images/s", _fmt(s["images_per_s"], 2)),
        ("denoising steps/s", _fmt(s["steps_per_s"], 1)),
        ("latency mean/p50/p95/p99 (s)", lat),
        ("queue time mean (s)", queue),
        ("SLO attainment", slo),
        ("goodput (req/s within SLO)", _fmt(s["goodput_rps"], 2)),
        ("max send lag (s)", _fmt(s["max_send_lag_s"])),
        ("stage occupancy", format_stages(s.get("stages", {}))),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * 72, *(f"{k:<{width}}{v}" for k, v in rows)]
    lines += [f"error: {e}" for e in s["errors"]]
    lines.append("=" * 72)
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """inf/nan are not JSON: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
