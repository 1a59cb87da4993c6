"""Side-by-side serving sweep: dvllm serve, the serial baseline and the static baseline, one run.

    python benchmarks/run_sweep.py                       # tiny-sd, 16x16, 20 steps, guidance 7.5 (2-core CPU: ~3-4 min)
    python benchmarks/run_sweep.py --size 32x32 --rate-factors 1,3 --num-requests 30

1. Starts the three servers on free ports (same model, same dummy-weight seed, same --server-threads)
   and waits for /health.
2. Measures what `serial` sustains: its throughput with a backlog (closed loop, 4 in flight) -> C req/s.
3. Poisson sweep at rate-factors x C; at each rate every engine runs the same requests (same seeds,
   same arrival offsets), the engines' order rotating from rate to rate so drift in this shared
   machine's load hits each alike.
4. The `mix` workload (random sizes, steps, guidance incl. no CFG, samplers), closed loop at
   --mix-concurrency, and the fixed workload closed loop at the same concurrency.
5. Writes every run's JSON under --output-dir/{sweep,mix,closed}/, summary.json, the latency figure,
   and stops the servers (also on Ctrl-C or an error).
6. With --profile (default): dvllm's per-phase step times offline (dvllm.benchmarks.throughput, 32
   requests) -> profile_32req.json and step_breakdown.png.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

import httpx

from dvllm.benchmarks import plot, serving
from dvllm.benchmarks.report import json_safe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's root

ENGINES = ("dvllm", "serial", "static")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess, logging to a file; stop() sends SIGTERM, then SIGKILL if it hangs."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, env: dict[str, str]) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env})

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def server_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    py = sys.executable
    common = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--log-level", "warning"]
    baseline = [py, "-m", "dvllm.benchmarks.baselines.server", *common]
    return {
        "dvllm": [py, "-m", "dvllm.entrypoints.cli", "serve", *common, "--max-batch-size", str(2 * args.max_batch)],
        "serial": [*baseline, "--mode", "serial"],
        "static": [*baseline, "--mode", "static", "--max-batch-size", str(args.max_batch),
                   "--batch-window-ms", str(args.batch_window_ms)],
    }


def rotated(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def bench(url: str, label: str, out: str | None, extra: list[str]) -> dict[str, Any]:
    """One `dvllm bench serve` run in this process; returns its summary."""
    parser = argparse.ArgumentParser()
    serving.add_cli_args(parser)
    args = parser.parse_args(["--base-url", url, "--label", label, *(["--output-json", out] if out else []),
                              *extra])
    serving.main(args)
    if out is None:
        return {}
    with open(out) as f:
        return json.load(f)["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--size", default="16x16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--rate-factors", default="1,2,3,4", help="Poisson rates as multiples of serial's capacity.")
    p.add_argument("--num-requests", type=int, default=48, help="Timed requests per sweep point and engine.")
    p.add_argument("--mix-requests", type=int, default=40)
    p.add_argument("--mix-concurrency", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8,
                   help="static: requests per call; dvllm gets 2x as denoiser rows (CFG rows count twice).")
    p.add_argument("--batch-window-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--server-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for the three servers, 0 to leave torch's default. Default 1: each "
                        "server runs torch on a thread other than the one that loaded the model, which "
                        "with torch's default (one thread per core) ran 1.4-2.9x slower on a 2-core CPU "
                        "(dvllm serve too); one thread is as fast here as two on the loading thread.")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="Also time dvllm's step phases offline (benchmark_throughput.py --profile, "
                        "--profile-requests requests) and plot step_breakdown.png (default: on).")
    p.add_argument("--profile-requests", type=int, default=32)
    p.add_argument("--output-dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = p.parse_args()
    engines = [e.strip() for e in args.engines.split(",")]
    if set(engines) - set(ENGINES) or "serial" not in engines:
        p.error(f"--engines must be a subset of {ENGINES} that includes serial (it sets the rates)")
    factors = [float(f) for f in args.rate_factors.split(",")]
    for sub in ("sweep", "mix", "closed", "logs"):
        os.makedirs(os.path.join(args.output_dir, sub), exist_ok=True)
    fixed = ["--size", args.size, "--steps", str(args.steps), "--guidance", str(args.guidance)]
    # Every run gets its own seed, hence its own prompts (no prompt-cache hits from an earlier run);
    # within a run, every engine gets the same requests.
    seeds = iter(range(args.seed, args.seed + 10_000, 10))
    started = time.monotonic()
    summary: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M")}
    with ExitStack() as stack:
        cmds = server_commands(args)
        threads = str(args.server_threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} if args.server_threads else {}
        servers = {}
        for name in engines:  # one at a time: model loads would otherwise fight over two cores
            servers[name] = Server(name, cmds[name], os.path.join(args.output_dir, "logs"), env)
            stack.callback(servers[name].stop)
            servers[name].wait_ready()
        print(f"servers up in {time.monotonic() - started:.0f} s: "
              + ", ".join(f"{n} {s.url}" for n, s in servers.items()), flush=True)

        # What serial sustains: its throughput with a backlog (so it never idles between requests).
        cal = bench(servers["serial"].url, "serial", os.path.join(args.output_dir, "closed", "serial_c4.json"),
                    [*fixed, "--seed", str(next(seeds)), "--num-requests", "12", "--warmup", "2",
                     "--max-concurrency", "4"])
        capacity = cal["requests_per_s"]
        summary["serial_capacity_rps"] = capacity
        print(f"serial sustains {capacity:.2f} requests/s", flush=True)

        summary["sweep"], sweep_files = {}, []
        for i, factor in enumerate(factors):
            rate, seed = round(factor * capacity, 2), str(next(seeds))
            for name in rotated(engines, i):
                out = os.path.join(args.output_dir, "sweep", f"{name}_x{factor:g}.json")
                s = bench(servers[name].url, name, out, [*fixed, "--seed", seed, "--num-requests",
                                                          str(args.num_requests), "--request-rate", str(rate),
                                                          "--warmup", "2"])
                summary["sweep"].setdefault(f"x{factor:g} ({rate} req/s)", {})[name] = s
                sweep_files.append(out)

        for i, (kind, extra) in enumerate((("mix", ["--workload", "mix"]), ("closed", fixed))):
            seed = str(next(seeds))
            for name in rotated(engines, i + len(factors)):
                out = os.path.join(args.output_dir, kind, f"{name}_c{args.mix_concurrency}.json")
                s = bench(servers[name].url, name, out, [*extra, "--seed", seed, "--num-requests",
                                                          str(args.mix_requests), "--max-concurrency",
                                                          str(args.mix_concurrency), "--warmup", "4"])
                summary.setdefault(f"{kind}_c{args.mix_concurrency}", {})[name] = s

    runs = plot.load_runs(sweep_files)
    figure = plot.plot_latency_throughput(runs, os.path.join(args.output_dir, "latency_vs_throughput.png"),
                                          f"{args.model} {args.size}, {args.steps} steps, guidance {args.guidance}: "
                                          f"Poisson sweep ({', '.join(f'{f:g}' for f in factors)} x serial)")
    summary["figure"] = figure
    if args.profile:  # after the servers stopped: the profile runs an engine in this process
        summary["breakdown_figure"] = profile_breakdown(args)
    summary["wall_s"] = time.monotonic() - started
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(json_safe(summary), f, indent=1)
    print_overview(summary, engines)
    print(f"\nfigures: {figure} {summary.get('breakdown_figure', '')}")
    print(f"all in {summary['wall_s']:.0f} s; JSON under {args.output_dir}")
    return 0


def profile_breakdown(args: argparse.Namespace) -> str:
    from dvllm.benchmarks import throughput

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    out = os.path.join(args.output_dir, f"profile_{args.profile_requests}req.json")
    targs = parser.parse_args(["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--size",
                               args.size, "--steps", str(args.steps), "--guidance", str(args.guidance),
                               "--num-requests", str(args.profile_requests), "--rounds", "1",
                               "--static-batch-sizes", str(args.max_batch), "--profile"])
    result = throughput.run(targs)
    throughput.print_report(result)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return plot.plot_breakdown({f"dvllm, {args.profile_requests} requests": plot.load_profile(out)},
                               os.path.join(args.output_dir, "step_breakdown.png"),
                               f"{args.model} {args.size}, {args.steps} steps: time per engine step")


def print_overview(summary: dict[str, Any], engines: list[str]) -> None:
    def row(point: str, results: dict[str, dict[str, Any]]) -> None:
        for name in engines:
            s = results.get(name)
            if s:
                print(f"{point:<24}{name:<8}{s['completed']:>5}/{s['failed']:<3}{s['requests_per_s']:>8.2f}"
                      f"{s['steps_per_s']:>9.1f}{s['latency_p50_s']:>8.2f}{s['latency_p95_s']:>8.2f}"
                      f"{s['latency_p99_s']:>8.2f}")
            point = ""

    print(f"\n{'point':<24}{'engine':<8}{'ok/fail':>9}{'req/s':>8}{'steps/s':>9}{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}")
    for point, results in summary["sweep"].items():
        row(point, results)
    for key in [k for k in summary if k.startswith(("mix_", "closed_"))]:
        row(key, summary[key])


if __name__ == "__main__":
    sys.exit(main())
