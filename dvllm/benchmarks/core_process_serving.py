"""A closed loop of streaming clients against two `dvllm serve` servers, the engine core in a process of its own
vs on a thread of the server's process: the engine's step time side by side.

Both servers are started at once (the same model and flags but `--engine-core-process` /
`--no-engine-core-process`, and the result cache off) and then driven one after the other, so each timed run has
the machine to itself while the other server idles. In each run `--concurrency` streaming clients (`"stream":
true`, `"response_format": "b64_json"`: the server encodes every image as a base64 PNG) each send their next
request as soon as the previous one finished, until `--num-requests` are done; every run sends the same requests
(captions and seeds). With `--rounds 2` (the default) the order is in-process, process, process, in-process, so a
drift in the machine's load weighs on both settings alike.

Per setting it reports the engine's step time (mean and P95, from each server's /metrics: the
dvllm_step_time_seconds histogram's sum, count and buckets before and after each run; the P95 is interpolated
within a bucket, as Prometheus's histogram_quantile does), the rows per step, the core's busy share (seconds
stepping over the runs' wall time), images/s, latency and time to first step (send to the response's headers,
which come with the first step's output) P50/P95, completed/failed, and the ratios process / in-process; and
whether each request's final image is pixel-equal in every run. In-process, the core's steps share the GIL with
the server's HTTP parsing, JSON, PNG encoding and base64; in a process of its own they share nothing but the
machine's cores.

    python -m dvllm.benchmarks.core_process_serving                 # the built-in tiny-shapes, 32 clients
    python -m dvllm.benchmarks.core_process_serving --num-requests 8 --concurrency 4 --steps 4 --size 32x32 \\
        --output-json c.json
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from dvllm.benchmarks.server_usage import format_stages, histogram_quantile, server_usage
from dvllm.benchmarks.stages_serving import (
    Record,
    Spec,
    _fmt,
    _ratio,
    compare_images,
    format_images,
    import_httpx,
    run_main,
    run_order,
    scrape_metrics,
    servers_up,
    stream_one,
    summarize,
    to_record,
    workload,
)
from dvllm.benchmarks.workloads import check_size

# The in-process core first: the order is in-process, process, process, in-process, ...
SETTINGS = {"in-process": "--no-engine-core-process", "process": "--engine-core-process"}
RATIO_KEYS = ("step_time_mean_s", "step_time_p95_s", "rows_per_step", "busy_share", "images_per_s",
              "latency_p50_s", "latency_p95_s", "ttfs_p50_s", "ttfs_p95_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dvllm.benchmarks.core_process_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="What both servers serve: a diffusers folder, Hub id or preset "
                                   "(default: the built-in tiny-shapes, as plain `dvllm serve`).")
    p.add_argument("--concurrency", type=int, default=32,
                   help="Streaming clients, each sending its next request when the previous one finished "
                        "(default: %(default)s).")
    p.add_argument("--num-requests", type=int, default=64, help="Timed requests per run (default: %(default)s).")
    p.add_argument("--steps", type=int, default=25, help="num_inference_steps of every request (default: %(default)s).")
    p.add_argument("--size", default="64x64", help="WxH of every image (default: %(default)s).")
    p.add_argument("--guidance", type=float, help="guidance_scale of every request (default: the model's).")
    p.add_argument("--partial-images", type=int, default=0,
                   help="Partial images each streaming client asks for; each is a preview decode, PNG and base64 "
                        "more (default: %(default)s).")
    p.add_argument("--rounds", type=int, default=2,
                   help="Runs per setting, in the order in-process, process, process, in-process, ... "
                        "(default: %(default)s).")
    p.add_argument("--warmup", type=int,
                   help="Untimed streaming requests each server gets first, all at once (default: --concurrency, "
                        "so the full batches' shapes are warm).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the prompts and image seeds (default: %(default)s).")
    p.add_argument("--server-args", default="",
                   help="Further `dvllm serve` flags for both servers, one string (e.g. '--max-batch-size 8').")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="Seconds a server may take to answer /health (default: %(default)s).")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request HTTP timeout, s (default: %(default)s).")
    p.add_argument("--output-json", help="Write the summary and every request's record here.")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.warmup is None:
        args.warmup = args.concurrency
    for name, low in (("concurrency", 1), ("num_requests", 1), ("steps", 1), ("rounds", 1), ("partial_images", 0),
                      ("warmup", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.partial_images >= args.steps:
        raise ValueError(f"--partial-images must be below --steps ({args.steps}), got {args.partial_images}")
    flags = shlex.split(args.server_args)
    if any(f.split("=")[0] in ("--engine-core-process", "--no-engine-core-process") for f in flags):
        raise ValueError("--server-args must not set --engine-core-process: the benchmark sets it per server")
    args.size = check_size(args.size, "--size")


async def run_closed(url: str, setting: str, round_: int, specs: list[Spec], warm: list[Spec],
                     args: argparse.Namespace) -> tuple[list[Record], dict[int, np.ndarray], float, dict[str, Any]]:
    """Drives one server with the closed loop: (records, final pixels by request index, duration, server usage)."""
    httpx = import_httpx()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        if warm:  # kernels, allocator, the batches' shapes and the first requests' one-off costs out of the run
            now = time.perf_counter()
            for result in await asyncio.gather(*(stream_one(client, s.body(args), now) for s in warm)):
                if result["error"]:
                    print(f"warning: a warm-up request to the {setting} server failed: {result['error']}")
        before = await scrape_metrics(client)
        results: list[dict[str, Any] | None] = [None] * len(specs)
        todo = iter(enumerate(specs))  # shared: each client takes the next request (no await between take and send)

        async def client_loop() -> None:
            for index, spec in todo:
                results[index] = await stream_one(client, spec.body(args), start)

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(args.concurrency, len(specs)))))
        duration = time.perf_counter() - start
        after = await scrape_metrics(client)
    records, pixels = [], {}
    for index, r in enumerate(results):
        record, image = to_record(setting, round_, index, r["sent"], r)  # closed loop: sent when a client was free
        records.append(record)
        if image is not None:
            pixels[index] = image
    return records, pixels, duration, server_usage(before, after, duration)


def step_summary(usages: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The runs' steps combined: mean over all steps, P95 from the summed buckets, rows per step, the share of
    the runs' wall time spent stepping, and each run's mean; None where a server's /metrics had no steps."""
    runs = [(d, u["step_time"]) for d, u in usages]
    empty = {"steps": 0, "step_time_mean_s": None, "step_time_p95_s": None, "rows_per_step": None,
             "busy_share": None, "step_time_mean_s_per_run": [None if s is None else s["mean_s"] for _, s in runs]}
    known = [(d, s) for d, s in runs if s is not None]
    if not known or len(known) < len(runs):
        return empty
    steps = sum(s["steps"] for _, s in known)
    seconds = sum(s["seconds"] for _, s in known)
    duration = sum(d for d, _ in known)
    buckets: dict[float, float] = {}
    for _, s in known:
        for upper, count in s["buckets"]:
            buckets[upper] = buckets.get(upper, 0.0) + count
    rows = sum(s["rows_per_step"] * s["steps"] for _, s in known if s["rows_per_step"] is not None)
    return {**empty, "steps": steps, "step_time_mean_s": seconds / steps if steps else None,
            "step_time_p95_s": histogram_quantile(0.95, sorted(buckets.items())),
            "rows_per_step": rows / steps if steps else None,
            "busy_share": seconds / duration if duration > 0 else None}


def per_run_throughput(records: list[Record], usages: list[tuple[float, dict[str, Any]]]) -> list[float | None]:
    """Images/s of each run (its completed requests over its wall time), in round order."""
    return [sum(r.ok for r in records if r.round == round_) / duration if duration > 0 else None
            for round_, (duration, _) in enumerate(usages)]


def ratios(settings: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """process / in-process of each figure in RATIO_KEYS (None where either is missing or in-process is 0)."""
    return {key: _ratio(settings["process"].get(key), settings["in-process"].get(key)) for key in RATIO_KEYS}


def format_report(result: dict[str, Any]) -> str:
    s, r = result["settings"], result["ratios_process_in_process"]

    def ms(value: float | None) -> float | None:
        return None if value is None else 1000 * value

    rows = [("", "in-process (a thread)", "process (its own)", "process / in-process")]
    for label, key, scale, digits in (
            ("step time mean (ms)", "step_time_mean_s", ms, 1), ("step time P95 (ms, histogram)", "step_time_p95_s",
                                                                 ms, 1),
            ("rows per step", "rows_per_step", None, 1), ("core busy share", "busy_share", None, 3),
            ("images/s", "images_per_s", None, 3), ("latency P50 (s)", "latency_p50_s", None, 2),
            ("latency P95 (s)", "latency_p95_s", None, 2), ("time to first step P50 (s)", "ttfs_p50_s", None, 3),
            ("time to first step P95 (s)", "ttfs_p95_s", None, 3)):
        cells = [_fmt((scale or (lambda v: v))(s[k][key]), digits) for k in SETTINGS]
        rows.append((label, *cells, _fmt(r.get(key), 3) + ("x" if r.get(key) is not None else "")))
    rows.append(("completed / failed", *(f"{s[k]['completed']} / {s[k]['failed']}" for k in SETTINGS), ""))
    width = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [result["command"], result["load"], ""]
    lines += ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.append("")
    for k in SETTINGS:
        steps = ", ".join(_fmt(ms(v), 1) for v in s[k]["step_time_mean_s_per_run"])
        images = ", ".join(_fmt(v, 2) for v in s[k]["images_per_s_per_run"])
        lines.append(f"{k}: per run, step time mean (ms) {steps}; images/s {images}")
        lines.append(f"  stages {format_stages(s[k]['stages'])}")
        lines += [f"  error ({k}): {e}" for e in s[k]["errors"]]
    lines.append(format_images(result["images"], result["rounds"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    httpx = import_httpx()
    specs = workload(args.num_requests, args.seed)
    warm = workload(args.warmup, args.seed + 1)
    common = ["--log-level", "warning", "--result-cache-mb", "0", *shlex.split(args.server_args)]
    records: list[Record] = []
    pixels: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    usages: dict[str, list[tuple[float, dict[str, Any]]]] = {k: [] for k in SETTINGS}
    load_before = os.getloadavg()
    order = run_order(tuple(SETTINGS), args.rounds)
    with servers_up(args.model, {k: [*common, flag] for k, flag in SETTINGS.items()}, httpx,
                    args.startup_timeout) as servers:
        for setting, round_ in order:
            print(f"run: {setting}, round {round_ + 1} of {args.rounds}", flush=True)
            recs, pix, duration, usage = asyncio.run(run_closed(servers[setting].url, setting, round_, specs,
                                                                warm if round_ == 0 else [], args))
            records += recs
            pixels[(setting, round_)] = pix
            usages[setting].append((duration, usage))
            if any(not r.ok for r in recs) or usage["step_time"] is None:  # the log goes with the server
                print(f"the {setting} server's log (a request failed or /metrics had no step times):\n"
                      f"{servers[setting].tail()}", flush=True)
    settings = {k: {**summarize([r for r in records if r.setting == k], usages[k]), **step_summary(usages[k]),
                    "images_per_s_per_run": per_run_throughput([r for r in records if r.setting == k], usages[k])}
                for k in SETTINGS}
    load_after = os.getloadavg()
    return {
        "command": ("python -m dvllm.benchmarks.core_process_serving "
                    + shlex.join(sys.argv[1:] if args.argv is None else args.argv)).rstrip(),
        "load": (f"model {args.model or 'tiny-shapes (built in)'}, {args.num_requests} streaming requests per run "
                 f"from {args.concurrency} clients in a closed loop (seed {args.seed}), {args.size}, {args.steps} "
                 f"steps, {args.partial_images} partial images, b64_json; both servers up, driven one after the "
                 f"other ({', '.join(f'{s} r{r + 1}' for s, r in order)}); {os.cpu_count()} CPUs, load average "
                 f"{load_before[0]:.2f} before / {load_after[0]:.2f} after"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "rounds": args.rounds,
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "settings": settings, "ratios_process_in_process": ratios(settings),
        "images": compare_images(pixels, args.num_requests),
        "requests": [asdict(r) for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    return run_main("core_process_serving", build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
