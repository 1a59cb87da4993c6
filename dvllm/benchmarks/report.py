"""Per-request records of a benchmark (`bench serve`, `bench run`), and the summary, table and JSON made from them."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dvllm.benchmarks.server_usage import format_stages

if TYPE_CHECKING:
    from dvllm.benchmarks.workloads import RequestSpec

MAX_ERRORS_SHOWN = 5


def machine_label(device: Any, dtype: Any) -> str:
    """The device (the GPU's name, or the CPU's), torch's threads and version, and the dtype a figure was taken in."""
    import platform

    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return f"{device.type}:{name}, {torch.get_num_threads()} threads, torch {torch.__version__}, {dtype}"


def emit_json(result: dict[str, Any], path: str | None) -> None:
    """A benchmark's result printed as JSON, and written to `path` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


@dataclass
class Outcome:
    latency: float | None  # send to final output, seconds; None if it failed
    first_step: float | None  # send to its first step (serial: to its pipeline call), seconds
    error: str | None
    queue: float | None = None  # the engine's arrival to its first scheduled step (serial: to its pipeline call)
    service: float | None = None  # first scheduled step to finished


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


# -- dvllm bench run's report (harness.py) --

def record(i: int, spec: RequestSpec, outcome: Outcome, slo: float) -> RequestRecord:
    return RequestRecord(index=i, arrival=spec.arrival or 0.0, sent=spec.arrival or 0.0, latency=outcome.latency,
                         ok=outcome.error is None, status=None, error=outcome.error, steps=spec.steps, n=spec.n,
                         size=spec.size, guidance=spec.guidance, sampler=spec.sampler, slo=slo)


def run_summary(specs: list[RequestSpec], outcomes: list[Outcome], slos: list[float], duration: float
                ) -> dict[str, Any]:
    records = [record(i, s, o, slo) for i, (s, o, slo) in enumerate(zip(specs, outcomes, slos))]
    summary = summarize(records, duration, None)

    def ps(values: list[float | None], *qs: int) -> list[float | None]:
        kept = [v for v in values if v is not None]
        return [percentile(kept, q) for q in qs]

    first_p50, first_p99 = ps([o.first_step for o in outcomes], 50, 99)
    queue_p50, queue_p99 = ps([o.queue for o in outcomes], 50, 99)
    (service_p50,) = ps([o.service for o in outcomes], 50)
    summary.update(first_step_p50_s=first_p50, first_step_p99_s=first_p99, queue_p50_s=queue_p50,
                   queue_p99_s=queue_p99, service_p50_s=service_p50,
                   latencies=sorted(round(o.latency, 4) for o in outcomes if o.latency is not None),
                   slo_shares=sorted(round(o.latency / slo, 4) for o, slo in zip(outcomes, slos)
                                     if o.latency is not None))  # <= 1: met
    return summary


def ratios(contenders: dict[str, list[dict[str, Any]]]) -> str | None:
    """Each contender's images/s (median over rounds) against serial's and the best static batch's, where run."""
    ips = {name: statistics.median(s["images_per_s"] or 0.0 for s in summaries)
           for name, summaries in contenders.items()}
    statics = [n for n in ips if n.startswith("static")]
    parts = []
    for base in (["serial"] if "serial" in ips else []) + ([max(statics, key=ips.get)] if statics else []):
        if ips[base] > 0:
            parts.append(f"vs {base}: " + ", ".join(f"{n} {v / ips[base]:.2f}x" for n, v in ips.items() if n != base))
    return "  images/s " + "; ".join(parts) if parts else None


def format_results(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests on {result['model']}, SLO {result['slo_factor']:g}x solo latency "
             f"({result['solo_kinds']} kinds measured alone), {result['rounds']} round(s):"]
    lines.append(f"  {'rate':>5} {'contender':<10}{'ok/failed':>10}{'req/s':>8}{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}"
                 f"{'1st step':>9}{'queue':>7}{'service':>8}{'SLO met':>8}{'goodput':>8}")

    def f(v: float | None, d: int = 2) -> str:
        return "n/a" if v is None else f"{v:.{d}f}"

    for run in result["runs"]:
        rate = "trace" if run["rate"] is None else f"{run['rate']:g}"
        for name, summaries in run["contenders"].items():
            for s in summaries:
                gaps = "" if "forwards" not in s else (
                    f"  {s['forwards']} forwards, gaps p50 {f(s['forward_gap_p50_s'], 4)} s max "
                    f"{f(s['forward_gap_max_s'], 4)} s")
                lines.append(f"  {rate:>5} {name:<10}{s['completed']:>5}/{s['failed']:<4}{f(s['requests_per_s']):>8}"
                             f"{f(s['latency_p50_s']):>8}{f(s['latency_p95_s']):>8}{f(s['latency_p99_s']):>8}"
                             f"{f(s['first_step_p50_s']):>9}{f(s['queue_p50_s']):>7}{f(s['service_p50_s']):>8}"
                             f"{f(100 * (s['slo_attainment'] or 0), 0) + '%':>8}{f(s['goodput_rps']):>8}{gaps}")
        if (line := ratios(run["contenders"])) is not None:
            lines.append(line)
    for name, profile in result.get("profiles", {}).items():
        phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in profile["ms_per_step"].items())
        lines.append(f"  {name}'s step profile over {profile['steps']} steps, ms a step: {phases}")
    return "\n".join(lines)
