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
import base64
import contextlib
import hashlib
import io
import itertools
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from dvllm.benchmarks.report import json_safe, percentile
from dvllm.benchmarks.server_usage import format_stages, server_usage
from dvllm.benchmarks.workloads import arrival_times, check_size
from dvllm.tiny_shapes.data import COLORS, POSITIONS, SHAPES, SIZES, Scene

ENDPOINT = "/v1/images/generations"
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


@dataclass
class Record:
    setting: str
    round: int
    index: int
    arrival: float                  # scheduled send offset, s from the run's start
    sent: float                     # actual send offset
    ok: bool
    error: str | None
    ttfs: float | None              # send to the response's headers (the first step's output)
    first_partial: float | None     # send to the first partial image's event
    latency: float | None           # send to the final image's event
    partials: int = 0
    image_sha256: str | None = None  # of the final image's pixels


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dvllm serve` in a subprocess on a free port, its output in a temporary log."""

    def __init__(self, model: str | None, flags: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="dvllm-stages-", suffix=".log", delete=False)
        self.cmd = [sys.executable, "-m", "dvllm.entrypoints.cli", "serve", *([model] if model else []),
                    "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, httpx: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(self.cmd)} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{shlex.join(self.cmd)} did not answer /health in {timeout:g} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:  # someone cleaned /tmp: the error must not hide what went wrong
            return f"(the server's log is unreadable: {e})"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:  # a hung shutdown must not hang the benchmark
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log.name)


async def stream_one(client: Any, body: dict[str, Any], start: float) -> dict[str, Any]:
    """One streaming request: times of its headers, first partial image and final image, and the final PNG."""
    httpx = _httpx()
    sent = time.perf_counter()
    out: dict[str, Any] = {"sent": sent - start, "ttfs": None, "first_partial": None, "latency": None,
                           "partials": 0, "error": None, "b64": None}
    try:
        async with client.stream("POST", ENDPOINT, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                out["error"] = f"HTTP {response.status_code}: {response.text[:300]}"
                return out
            out["ttfs"] = time.perf_counter() - sent
            event = None
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[len("event:"):].strip()
                elif line.startswith("data:") and event is not None:
                    now = time.perf_counter() - sent  # before parsing: the event is in at this point
                    if event.endswith(".partial_image"):
                        out["partials"] += 1
                        if out["first_partial"] is None:
                            out["first_partial"] = now
                    elif event.endswith(".completed"):
                        out["latency"], out["b64"] = now, json.loads(line[len("data:"):])["b64_json"]
                    elif event == "error":
                        out["error"] = str(json.loads(line[len("data:"):]).get("error", {}).get("message"))[:300]
                    event = None
            if out["error"] is None and out["b64"] is None:
                out["error"] = "the stream ended without a completed event"
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return out


async def _scrape(client: Any) -> str | None:
    try:
        response = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - the stage figures are optional: no /metrics means n/a
        return None
    return response.text if response.status_code == 200 else None


async def run_once(url: str, setting: str, round_: int, specs: list[Spec], warm: list[Spec], arrivals: list[float],
                   args: argparse.Namespace) -> tuple[list[Record], dict[int, np.ndarray], float, dict[str, Any]]:
    """Drives one server with the schedule: (records, final pixels by request index, duration, server usage)."""
    httpx = _httpx()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        if warm:  # kernels, allocator and the first requests' one-off costs out of the timed run
            now = time.perf_counter()
            for result in await asyncio.gather(*(stream_one(client, s.body(args), now) for s in warm)):
                if result["error"]:
                    print(f"warning: a warm-up request to the {setting} server failed: {result['error']}")
        before = await _scrape(client)
        start = time.perf_counter()
        tasks = []
        for spec, arrival in zip(specs, arrivals):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_one(client, spec.body(args), start)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _scrape(client)
    records, pixels = [], {}
    for index, (arrival, r) in enumerate(zip(arrivals, results)):
        record, image = to_record(setting, round_, index, arrival, r)
        records.append(record)
        if image is not None:
            pixels[index] = image
    return records, pixels, duration, server_usage(before, after, duration)


def to_record(setting: str, round_: int, index: int, arrival: float,
              r: dict[str, Any]) -> tuple[Record, np.ndarray | None]:
    """stream_one's result as a Record, and its final image's pixels (None if it failed)."""
    pixels = digest = None
    if r["b64"] is not None:
        with Image.open(io.BytesIO(base64.b64decode(r["b64"]))) as image:
            pixels = np.asarray(image.convert("RGB"))
        digest = hashlib.sha256(pixels.tobytes()).hexdigest()
    ok = r["error"] is None
    return Record(setting, round_, index, arrival, r["sent"], ok, r["error"], r["ttfs"], r["first_partial"],
                  r["latency"] if ok else None, r["partials"], digest), pixels


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


def compare_images(pixels: dict[tuple[str, int], dict[int, np.ndarray]], num: int) -> dict[str, Any]:
    """Each request's final image in every pair of runs: pixel-equal or not, the largest difference (0-255) and
    how many values differ, apart for pairs of one setting (other rounds) and pairs across the settings."""
    runs = list(pixels)
    equal = compared = 0
    worst = {"same_setting": 0, "across_settings": 0}
    differing = {"same_setting": 0, "across_settings": 0}
    values = {"same_setting": 0, "across_settings": 0}
    for index in range(num):
        if not all(index in pixels[run] for run in runs):  # failed somewhere: nothing to compare
            continue
        compared += 1
        same = True
        for a, b in itertools.combinations(runs, 2):
            kind = "same_setting" if a[0] == b[0] else "across_settings"
            x, y = pixels[a][index], pixels[b][index]
            if x.shape != y.shape:
                d, n = 255, x.size
            else:
                diff = np.abs(x.astype(np.int16) - y)
                d, n = int(diff.max()), int(np.count_nonzero(diff))
            worst[kind] = max(worst[kind], d)
            differing[kind] += n
            values[kind] += x.size
            same = same and d == 0
        equal += same
    return {"requests_compared": compared, "requests_pixel_equal": equal,
            "images_equal": compared == num and equal == compared,
            "max_abs_diff_0_255": worst, "values_differing": differing, "values_compared": values}


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


def format_images(im: dict[str, Any], rounds: int) -> str:
    """compare_images' answer for two settings' runs, one line."""
    across = (f"across the settings max abs diff {im['max_abs_diff_0_255']['across_settings']}/255, "
              f"{im['values_differing']['across_settings']} of {im['values_compared']['across_settings']} values "
              f"differ")
    if rounds > 1:
        across += (f"; within a setting, across rounds: max {im['max_abs_diff_0_255']['same_setting']}/255, "
                   f"{im['values_differing']['same_setting']} of {im['values_compared']['same_setting']} values")
    return (f"images equal: {'yes' if im['images_equal'] else 'no'} ({im['requests_pixel_equal']} of "
            f"{im['requests_compared']} requests pixel-equal in all {2 * rounds} runs; {across})")


def _httpx() -> Any:
    try:
        import httpx
    except ModuleNotFoundError:  # not a dependency of the engine itself
        raise ValueError("this benchmark needs httpx: pip install 'dvllm[bench]' (or pip install httpx)") from None
    return httpx


def run_order(settings: tuple[str, str], rounds: int) -> list[tuple[str, int]]:
    """(setting, round) of each run: a, b, b, a, a, b, ...: a drifting load weighs on both settings alike."""
    a, b = settings
    return [(s, round_) for round_ in range(rounds) for s in ((a, b) if round_ % 2 == 0 else (b, a))]


@contextlib.contextmanager
def servers_up(model: str | None, flags: dict[str, list[str]], httpx: Any,
               startup_timeout: float) -> Iterator[dict[str, Server]]:
    """One `dvllm serve` per setting with its flags, all started at once (the loads overlap, the runs do not)
    and ready; all stopped on the way out, a SIGTERM (a killed job) included."""
    servers: dict[str, Server] = {}
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if in_main else None
    try:
        for setting, setting_flags in flags.items():
            servers[setting] = Server(model, setting_flags)
        for server in servers.values():
            server.wait_ready(httpx, startup_timeout)
        yield servers
    finally:
        for server in servers.values():
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001 - one server's trouble must not leave the others running
                print(f"warning: stopping {shlex.join(server.cmd)} failed: {type(e).__name__}: {e}", flush=True)
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    httpx = _httpx()
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


def run_main(name: str, parser: argparse.ArgumentParser, run_fn: Any, report_fn: Any, argv: list[str] | None) -> int:
    """A two-server benchmark's command: run, print the report, write the JSON; 1 if a request failed."""
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        result = run_fn(args)
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        parser.exit(2, f"{name}: error: {e}\n")
    print(report_fn(result))
    if args.output_json:
        folder = os.path.dirname(args.output_json)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(json_safe(result), f, indent=1)
    return 0 if all(s["failed"] == 0 for s in result["settings"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
