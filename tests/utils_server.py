"""The real `dvllm serve` in a subprocess on a free port (as vLLM's tests start theirs), the tiny servers'
arguments, and helpers that read what a server reports (/metrics, errors, images) or drop a connection."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from dvllm.fork_server import start_child

FAST = {"num_inference_steps": 4, "size": "16x16"}
BASE_ARGS = ["--device", "cpu", "--dtype", "float32", "--state-pool-mb", "32", "--max-image-pixels", "4096",
             "--max-images-per-prompt", "4", "--max-body-mb", "0.25", "--log-level", "warning"]
# A request that outlasts any timeout or grace period a test sets, however fast the machine: 20,000 steps
# are minutes at the ~10 ms a step takes here, and still 20 s at 1 ms. Past 1000 steps DDIM (the model's
# own sampler) refuses, so these use euler; the server is started with MAX_STEPS to accept them.
ENDLESS = {"num_inference_steps": 20_000, "sampler": "euler", "size": "16x16"}
MAX_STEPS = ["--max-inference-steps", "20000"]
WAIT = 120.0  # s: bound on waiting for something the server reports; reached only when it is broken


def wait_until(predicate, timeout: float = WAIT, what: str = "condition") -> None:
    """Polls predicate until it holds; the timeout is reached only when something is broken."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """Starts `dvllm serve [MODEL] ARGS` and waits for GET /health to answer 200.

    The server is forked by this process's fork server (dvllm/fork_server.py: `dvllm.entrypoints.cli:main` with
    the same argv), which forks its engine core too: what a test examines is the server, not the imports a fresh
    interpreter makes (5 s of CPU each, twice a server). `fresh=True` starts `python -m dvllm.entrypoints.cli serve`
    as a user types it, with a fork server of its own: for the tests of its process tree."""

    def __init__(self, model: str | None, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 600.0, fresh: bool = False) -> None:
        # A bound for a hang only (a server that fails exits, and that is seen at once): on a loaded
        # 2-core machine loading the model has taken 100 s.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="dvllm-serve-", suffix=".log", delete=False)
        argv = ["serve", *([model] if model else []), "--port", str(self.port), *args]
        if fresh:
            self.proc = subprocess.Popen([sys.executable, "-m", "dvllm.entrypoints.cli", *argv], stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})})
        else:
            self.proc = start_child("dvllm.entrypoints.cli:main", "dvllm-serve", args=argv,
                                    env={**os.environ, **(env or {})}, stdout=self._log.fileno(),
                                    stderr=self._log.fileno())
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dvllm serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"dvllm serve did not become healthy in {timeout} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it hangs; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def png_pixels(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def assert_pixels_of(got: np.ndarray, image: np.ndarray) -> None:
    """uint8 pixels from another process are the float image rounded as diffusers' numpy_to_pil rounds it, but
    where a value sits within 1e-3 of a level's half: there the two processes' float noise (CPU kernels pick
    their paths by a tensor's alignment in memory, ~1e-7) may round it either way, by one level."""
    scaled = image * 255
    want = scaled.round().astype(np.uint8)
    tie = np.abs(scaled - np.floor(scaled) - 0.5) < 1e-3
    differ = got != want
    assert not (differ & ~tie).any() and (np.abs(got.astype(int) - want) <= 1).all(), \
        f"{int((differ & ~tie).sum())} pixels differ away from a rounding tie"


def metrics(url: str) -> dict[str, float]:
    """Every sample, keyed by name and labels: {'dvllm_requests_total{outcome="success"}': 3.0, ...}."""
    text = httpx.get(url + "/metrics", timeout=WAIT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def running(url: str) -> float:
    return metrics(url)["dvllm_num_requests_running"]


def assert_idle(url: str) -> None:
    """No request holds engine state: none running or waiting, no pool block held by a request."""
    def idle() -> bool:
        m = metrics(url)
        return (m["dvllm_num_requests_running"], m["dvllm_num_requests_waiting"], m["dvllm_pool_used_blocks"],
                m["dvllm_server_requests_in_flight"]) == (0, 0, 0, 0)
    wait_until(idle, what="the engine to be idle")


def raw_post(url: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """Sends a generation request on a bare socket, so the test can drop the connection at will."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = {"Host": f"{host}:{port}", "Content-Type": "application/json", "Content-Length": str(len(data)),
            **(headers or {})}
    sock.sendall(("POST /v1/images/generations HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
                  + "\r\n").encode() + data)
    return sock


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in response.text
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]
