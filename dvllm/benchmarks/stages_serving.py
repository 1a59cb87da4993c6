"""A Poisson workload of streaming clients against two `dvllm serve` servers, the decode stage on vs off.

Both servers are started at once (the same model and flags but `--decode-stage` / `--no-decode-stage`, and the
result cache off) and then driven one after the other, so each timed run has the machine to itself while the
other server idles. Each run sends the same seeded Poisson schedule of the same requests, every one a streaming
client (`"stream": true`); with `--rounds 2` (the default) the order is off, on, on, off, so a drift in the
machine's load weighs on both settings alike.

Per request it records the time to the first step (send to the response's headers: the server sends them
with the first step's output, before any event), the time to the first partial image (with
`--partial-images`), the latency (send to the final image's event) and ok/error. Per setting it reports
completed/failed, images/s, P50/P95 latency and time to first step, the stages' occupancy from each
server's /metrics, and on/off ratios; and whether each request's final image is pixel-equal in every run.

    python -m dvllm.benchmarks.stages_serving                      # the built-in tiny-shapes, a few minutes
    python -m dvllm.benchmarks.stages_serving --num-requests 8 --steps 4 --size 32x32 --output-json s.json
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dvllm.benchmarks.report import percentile
from dvllm.benchmarks.server_pair import (
    Record,
    compare_images,
    format_images,
    import_httpx,
    run_main,
    run_order,
    scrape_metrics,
    servers_up,
    stream_one,
    to_record,
)
from dvllm.benchmarks.server_usage import format_stages, server_usage
from dvllm.benchmarks.workloads import arrival_times, check_size
from dvllm.tiny_shapes.data import COLORS, POSITIONS, SHAPES, SIZES, Scene

SETTINGS = {"off": "--no-decode-stage", "on": "--decode-stage"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dvllm.benchmarks.stages_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="What both servers serve: a diffusers folder, Hub id or preset "
                                   "(default: the built-in tiny-shapes, as plain `dvllm serve`).")
    p.add_argument("--num-requests", type=int, default=12, help="Timed requests per run (default: %(default)s).")
    p.add_argument("--request-rate", type=float, default=0.15,
                   help="Mean Poisson arrivals per second (default: %(default)s).")
    p.add_argument("--steps", type=int, default=25, help="num_inference_steps of every request (default: %(default)s).")
    p.add_argument("--size", default="64x64", help="WxH of every image (default: %(default)s).")
    p.add_argument("--guidance", type=float, help="guidance_scale of every request (default: the model's).")
    p.add_argument("--partial-images", type=int, default=2,
                   help="Partial images each streaming client asks for; each is a preview decode "
                        "(default: %(default)s).")
    p.add_argument("--rounds", type=int, default=2,
                   help="Runs per setting, in the order off, on, on, off, ... (default: %(default)s).")
    p.add_argument("--warmup", type=int, default=2,
                   help="Untimed streaming requests each server gets first, all at once (default: %(default)s).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the arrivals, prompts and image seeds "
                                                       "(default: %(default)s).")
    p.add_argument("--server-args", default="",
                   help="Further `dvllm serve` flags for both servers, one string (e.g. '--max-batch-size 8').")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="Seconds a server may take to answer /health (default: %(default)s).")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request HTTP timeout, s (default: %(default)s).")
    p.add_argument("--output-json", help="Write the summary and every request's record here.")
    return p


@dataclass
class Spec:
    prompt: str
    seed: int

    def body(self, args: argparse.Namespace) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": self.prompt, "seed": self.seed, "size": args.size,
                                "num_inference_steps": args.steps, "stream": True,
                                "partial_images": args.partial_images, "response_format": "b64_json"}
        if args.guidance is not None:
            body["guidance_scale"] = args.guidance
        return body


def workload(num: int, seed: int) -> list[Spec]:
    """Captions the tiny-shapes model knows (any model takes them), each with its own image seed."""
    rng = random.Random(seed)
    specs = []
    for _ in range(num):
        scene = Scene(rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(list(SIZES)),
                      rng.choice(list(POSITIONS)))
        specs.append(Spec(scene.caption(rng), rng.randrange(2**31)))
    return specs


def check_args(args: argparse.Namespace) -> None:
    for name, low in (("num_requests", 1), ("steps", 1), ("rounds", 1), ("partial_images", 0), ("warmup", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not args.request_rate > 0 or math.isinf(args.request_rate) or math.isnan(args.request_rate):
        raise ValueError(f"--request-rate must be a finite rate > 0 (a Poisson workload), got {args.request_rate}")
    if args.partial_images >= args.steps:
        raise ValueError(f"--partial-images must be below --steps ({args.steps}), got {args.partial_images}")
    args.size = check_size(args.size, "--size")


async def run_once(url: str, setting: str, round_: int, specs: list[Spec], warm: list[Spec], arrivals: list[float],
                   args: argparse.Namespace) -> tuple[list[Record], dict[int, np.ndarray], float, dict[str, Any]]:
    """Drives one server with the schedule: (records, final pixels by request index, duration, server usage)."""
    httpx = import_httpx()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        if warm:  # kernels, allocator and the first requests' one-off costs out of the timed run
            now = time.perf_counter()
            for result in await asyncio.gather(*(stream_one(client, s.body(args), now) for s in warm)):
                if result["error"]:
                    print(f"warning: a warm-up request to the {setting} server failed: {result['error']}")
        before = await scrape_metrics(client)
        start = time.perf_counter()
        tasks = []
        for spec, arrival in zip(specs, arrivals):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_one(client, spec.body(args), start)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape_metrics(client)
    records, pixels = [], {}
    for index, (arrival, r) in enumerate(zip(arrivals, results)):
        record, image = to_record(setting, round_, index, arrival, r)
        records.append(record)
        if image is not None:
            pixels[index] = image
    return records, pixels, duration, server_usage(before, after, duration)


def _stages(usages: list[tuple[float, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The runs' stage figures combined: occupancy over their summed wall time, ms per item over all items."""
    total = sum(d for d, _ in usages)
    busy: dict[str, float] = {}
    occ: dict[str, float] = {}
    items: dict[str, int] = {}
    for duration, usage in usages:
        for stage, s in usage["stages"].items():
            items[stage] = items.get(stage, 0) + s["items"]
            occ[stage] = occ.get(stage, 0.0) + (s["occupancy"] or 0.0) * duration
            busy[stage] = busy.get(stage, 0.0) + (s["ms_per_item"] or 0.0) * s["items"] / 1000
    return {stage: {"occupancy": occ[stage] / total if total > 0 else None, "items": items[stage],
                    "ms_per_item": 1000 * busy[stage] / items[stage] if items[stage] else None} for stage in items}


def summarize(records: list[Record], usages: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    duration = sum(d for d, _ in usages)
    lat = [r.latency for r in ok]
    ttfs = [r.ttfs for r in ok]
    partial = [r.first_partial for r in ok if r.first_partial is not None]
    errors = sorted({r.error for r in records if r.error})[:5]
    return {
        "runs": len(usages), "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": errors, "duration_s": duration,
        "images_per_s": len(ok) / duration if duration > 0 else None,
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "ttfs_p50_s": percentile(ttfs, 50), "ttfs_p95_s": percentile(ttfs, 95),
        "first_partial_p50_s": percentile(partial, 50), "first_partial_p95_s": percentile(partial, 95),
        "max_send_lag_s": max(r.sent - r.arrival for r in records),
        "stages": _stages(usages),
    }


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(result: dict[str, Any]) -> str:
    s, r, im = result["settings"], result["ratios_on_off"], result["images"]
    rows = [("", "off (the loop decodes)", "on (--decode-stage)", "on / off")]
    for label, key, digits in (("images/s", "images_per_s", 3), ("latency P50 (s)", "latency_p50_s", 2),
                               ("latency P95 (s)", "latency_p95_s", 2), ("time to first step P50 (s)", "ttfs_p50_s", 3),
                               ("time to first step P95 (s)", "ttfs_p95_s", 3),
                               ("first partial image P50 (s)", "first_partial_p50_s", 2),
                               ("first partial image P95 (s)", "first_partial_p95_s", 2)):
        rows.append((label, _fmt(s["off"][key], digits), _fmt(s["on"][key], digits),
                     _fmt(r.get(key), 3) + ("x" if r.get(key) is not None else "")))
    rows.append(("completed / failed", *(f"{s[k]['completed']} / {s[k]['failed']}" for k in ("off", "on")), ""))
    width = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [result["command"], result["load"], ""]
    lines += ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.append("")
    for k in ("off", "on"):
        lines.append(f"stages {k}: {format_stages(s[k]['stages'])}")
        lines += [f"  error ({k}): {e}" for e in s[k]["errors"]]
    lines.append(format_images(im, result["rounds"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    httpx = import_httpx()
    specs = workload(args.num_requests, args.seed)
    warm = workload(args.warmup, args.seed + 1)
    arrivals = arrival_times(args.num_requests, args.request_rate, 1.0, seed=args.seed)
    common = ["--log-level", "warning", "--result-cache-mb", "0", *shlex.split(args.server_args)]
    records: list[Record] = []
    pixels: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    usages: dict[str, list[tuple[float, dict[str, Any]]]] = {"off": [], "on": []}
    load_before = os.getloadavg()
    order = run_order(tuple(SETTINGS), args.rounds)
    with servers_up(args.model, {k: [*common, flag] for k, flag in SETTINGS.items()}, httpx,
                    args.startup_timeout) as servers:
        for setting, round_ in order:
            print(f"run: {setting}, round {round_ + 1} of {args.rounds}", flush=True)
            recs, pix, duration, usage = asyncio.run(run_once(servers[setting].url, setting, round_, specs,
                                                              warm if round_ == 0 else [], arrivals, args))
            records += recs
            pixels[(setting, round_)] = pix
            usages[setting].append((duration, usage))
    settings = {k: summarize([r for r in records if r.setting == k], usages[k]) for k in ("off", "on")}
    ratios = {key: _ratio(settings["on"][key], settings["off"][key])
              for key in ("images_per_s", "latency_p50_s", "latency_p95_s", "ttfs_p50_s", "ttfs_p95_s",
                          "first_partial_p50_s", "first_partial_p95_s")}
    load_after = os.getloadavg()
    return {
        "command": ("python -m dvllm.benchmarks.stages_serving "
                    + shlex.join(sys.argv[1:] if args.argv is None else args.argv)).rstrip(),
        "load": (f"model {args.model or 'tiny-shapes (built in)'}, {args.num_requests} streaming requests per run "
                 f"at {args.request_rate:g} req/s (Poisson, seed {args.seed}), {args.size}, {args.steps} steps, "
                 f"{args.partial_images} partial images; both servers up, driven one after the other "
                 f"({', '.join(f'{s} r{r + 1}' for s, r in order)}); {os.cpu_count()} CPUs, load average "
                 f"{load_before[0]:.2f} before / {load_after[0]:.2f} after"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "rounds": args.rounds,
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "settings": settings, "ratios_on_off": ratios,
        "throughput_held": ratios["images_per_s"] is not None and ratios["images_per_s"] >= 1.0,
        "images": compare_images(pixels, args.num_requests),
        "requests": [asdict(r) for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    return run_main("stages_serving", build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
