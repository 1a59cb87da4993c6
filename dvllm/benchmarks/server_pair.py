"""Two `dvllm serve` servers side by side, for benchmarks that compare one setting (stages_serving: the
decode stage; core_process_serving: the engine core's process): starting and stopping both, the order of
their runs, one streaming client's timings, /metrics scrapes, records, the images compared across runs,
and the command's main.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import io
import itertools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from dvllm.benchmarks.report import json_safe

ENDPOINT = "/v1/images/generations"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dvllm serve` in a subprocess on a free port, its output in a temporary log."""

    def __init__(self, model: str | None, flags: list[str]) -> None:
        self.port = free_port()
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
    httpx = import_httpx()
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


async def scrape_metrics(client: Any) -> str | None:
    try:
        response = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - the stage figures are optional: no /metrics means n/a
        return None
    return response.text if response.status_code == 200 else None


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


def import_httpx() -> Any:
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
