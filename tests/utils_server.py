"""RemoteServer: the real `dvllm serve` in a subprocess on a free port, as vLLM's tests start theirs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def wait_until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
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
    """Starts `python -m dvllm.entrypoints.cli serve [MODEL] ARGS` and waits for GET /health to answer 200."""

    def __init__(self, model: str | None, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 600.0) -> None:
        # A bound for a hang only (a server that fails exits, and that is seen at once): on a loaded
        # 2-core machine loading the model has taken 100 s.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="dvllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "dvllm.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
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
