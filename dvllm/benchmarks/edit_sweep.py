"""Image editing side by side: dvllm serve, the serial and the static baseline on the same edit requests.

    python -m dvllm.benchmarks.edit_sweep                  # qwen-image-edit-cpu, 64x64 out, 1-2 images of 48-80 px

As sweep.py does for generations: starts the three servers (same model, dummy-weight seed, --server-threads),
measures what `serial` sustains on the edit workload (closed loop, 2 in flight) -> C req/s, then sends every
engine the same --num-requests edit requests (multipart POST /v1/images/edits; same images, prompts, seeds)
at the same Poisson arrival offsets, rate --rate-factor x C, the engines in turn. Reports throughput
dvllm / serial, P95 latency dvllm / static and failures against the goals (>= 3x, <= 0.5x, none).

For QwenImageEditPlusPipeline (qwen-image-edit-cpu) the static baseline cannot batch requests: diffusers
refuses batch_size > 1 there (baselines/runner.py), so `static` runs them one per call, as serial does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

from dvllm.benchmarks.report import json_safe
from dvllm.benchmarks.sweep import ENGINES, REPO, Server, bench, server_commands

GOAL_THROUGHPUT, GOAL_P95 = 3.0, 0.5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen-image-edit-cpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--size", default="64x64", help="Output size (default: %(default)s).")
    p.add_argument("--edit-image-sizes", default="48x64,64x64,80x48")
    p.add_argument("--edit-images", default="1,2", help="Input images per request (default: %(default)s).")
    p.add_argument("--steps", default="2,4", help="Step counts to draw from (default: %(default)s).")
    p.add_argument("--guidance", default="1.0,4.0", help="> 1: CFG with a negative prompt (default: %(default)s).")
    p.add_argument("--rate-factor", type=float, default=3.0, help="Poisson rate as a multiple of serial's capacity.")
    p.add_argument("--num-requests", type=int, default=16, help="Timed requests per engine (default: 16).")
    p.add_argument("--calibration-requests", type=int, default=6)
    p.add_argument("--max-batch", type=int, default=8,
                   help="static: requests per call; dvllm gets 2x as denoiser rows (CFG rows count twice).")
    p.add_argument("--batch-window-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS per server, as sweep.py's.")
    p.add_argument("--sequential", action="store_true",
                   help="One server at a time (serial, static, dvllm: started, measured, stopped), for models of "
                        "which three copies do not fit in memory (qwen-image-edit on one GPU). Default: all three "
                        "up at once, as sweep.py.")
    p.add_argument("--output-dir", default=os.path.join(REPO, "benchmarks", "results", "edit"))
    args = p.parse_args(argv)
    os.makedirs(os.path.join(args.output_dir, "logs"), exist_ok=True)
    workload = ["--workload", "edit", "--size", args.size, "--edit-image-sizes", args.edit_image_sizes,
                "--edit-images", args.edit_images, "--mix-steps", args.steps, "--mix-guidance", args.guidance]
    started = time.monotonic()
    summary: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M")}
    cmds = server_commands(args)
    threads = str(args.server_threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} if args.server_threads else {}
    summary["runs"] = {}
    with ExitStack() as stack:
        servers: dict[str, Server] = {}

        def up(name: str) -> Server:
            servers[name] = Server(name, cmds[name], os.path.join(args.output_dir, "logs"), env)
            stack.callback(servers[name].stop)
            servers[name].wait_ready()
            return servers[name]

        def measure(name: str) -> None:  # every engine: the same requests (same --seed) at the same offsets
            out = os.path.join(args.output_dir, f"{name}_x{args.rate_factor:g}.json")
            summary["runs"][name] = bench(servers[name].url, name, out,
                                          [*workload, "--seed", str(args.seed), "--num-requests",
                                           str(args.num_requests), "--request-rate", str(summary["request_rate"]),
                                           "--warmup", "1"])
            if args.sequential:
                servers[name].stop()

        order = ["serial", "static", "dvllm"] if args.sequential else list(ENGINES)
        for name in ["serial"] if args.sequential else order:  # loads one at a time: they would fight over cores
            up(name)
        print(f"server(s) up in {time.monotonic() - started:.0f} s", flush=True)
        cal = bench(servers["serial"].url, "serial", os.path.join(args.output_dir, "serial_c2.json"),
                    [*workload, "--seed", str(args.seed + 1000), "--num-requests", str(args.calibration_requests),
                     "--warmup", "1", "--max-concurrency", "2"])
        capacity = cal["requests_per_s"]
        summary.update(serial_capacity_rps=capacity, request_rate=round(args.rate_factor * capacity, 3))
        print(f"serial sustains {capacity:.3f} requests/s; Poisson at {summary['request_rate']} req/s", flush=True)
        for name in order:
            if name not in servers:
                up(name)
            measure(name)
    runs = summary["runs"]
    summary["throughput_vs_serial"] = runs["dvllm"]["requests_per_s"] / runs["serial"]["requests_per_s"]
    summary["p95_vs_static"] = runs["dvllm"]["latency_p95_s"] / runs["static"]["latency_p95_s"]
    summary["failures"] = {name: s["failed"] for name, s in runs.items()}
    summary["wall_s"] = time.monotonic() - started
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(json_safe(summary), f, indent=1)
    print(f"\n{'engine':<8}{'ok/fail':>9}{'req/s':>8}{'steps/s':>9}{'p50 s':>8}{'p95 s':>8}{'queue s':>9}")
    for name, s in runs.items():
        queue = s.get("queue_time_mean_s")
        print(f"{name:<8}{s['completed']:>5}/{s['failed']:<3}{s['requests_per_s']:>8.3f}{s['steps_per_s']:>9.2f}"
              f"{s['latency_p50_s']:>8.2f}{s['latency_p95_s']:>8.2f}{'' if queue is None else f'{queue:9.2f}'}")
    ok_t = summary["throughput_vs_serial"] >= GOAL_THROUGHPUT
    ok_p = summary["p95_vs_static"] <= GOAL_P95
    print(f"\nthroughput dvllm/serial {summary['throughput_vs_serial']:.2f}x (goal >= {GOAL_THROUGHPUT}: "
          f"{'met' if ok_t else 'missed'}); P95 dvllm/static {summary['p95_vs_static']:.2f}x (goal <= {GOAL_P95}: "
          f"{'met' if ok_p else 'missed'}); failures {summary['failures']}; all in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
