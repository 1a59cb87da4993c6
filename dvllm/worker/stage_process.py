"""A stage's worker process (a decode worker, an encode worker): a fresh interpreter that builds its part of the
model from a copy sent to it first, then answers one batch at a time over a pipe.

A process is spawned as the engine core process is (a new interpreter running `python -m <module>`: never a fork
of a process that holds CUDA or threads, and not multiprocessing's spawn, which imports the caller's main script
again). The lane thread that owns it sends a batch and waits for the answer, checking now and then that the
process lives; one found dead is spawned again and WorkerProcessLost is raised to the lane, which sends the batch
once more: no request is lost to a killed process.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# How often a lane waiting for its process checks that the process is still alive
_ALIVE_POLL_S = 1.0
_CLOSE_TIMEOUT_S = 10.0


class WorkerProcessLost(RuntimeError):
    """The stage's process died (killed, or crashed) before answering."""


class StageProcess:
    """One process and the pipe to it; used by one lane thread at a time."""

    kind = "stage"  # named in logs: "<kind> worker 0"
    module = ""  # the module the process runs (`python -m`), whose main calls serve()

    def __init__(self, copy: Callable[[], Any], device: str, threads: int, index: int) -> None:
        self._copy = copy  # what the process builds its part from, sent first to each process started
        self.device, self.threads, self.index = device, threads, index
        self.restarts = 0
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._built = False
        self._spawn()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def call(self, batch: Any) -> Any:
        """The process's answer to `batch`; raises RuntimeError with the process's error, or WorkerProcessLost
        (the process is spawned again before it is raised)."""
        try:
            if not self._built:
                self._call(("build", self._copy()))
                self._built = True
            return self._call(("run", batch))
        except (EOFError, OSError, WorkerProcessLost) as e:
            pid = self.pid
            self._respawn()
            raise WorkerProcessLost(f"{self.kind} worker {self.index} (pid {pid}) died: {type(e).__name__}") from None

    def close(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        try:
            self._process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()
        self._process = self._conn = None

    def _call(self, message: tuple[str, Any]) -> Any:
        self._send(message)
        return self._receive()

    def _send(self, message: tuple[str, Any]) -> None:
        self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _receive(self) -> Any:
        """The answer to the message sent last; raises as `call` says (WorkerProcessLost: not spawned again)."""
        while not self._conn.poll(_ALIVE_POLL_S):
            if self._process.poll() is not None:
                raise WorkerProcessLost("exited")
        status, value = pickle.loads(self._conn.recv_bytes())
        if status == "error":
            raise RuntimeError(value)
        return value

    def _spawn(self) -> None:
        parent, child = multiprocessing.Pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", self.module, str(child.fileno()), self.device, str(self.threads)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
            # its OpenMP threads sleep between batches instead of spinning on cores the worker's threads use
            env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ})
        child.close()  # the child's end lives in the child alone: its death ends the pipe
        self._conn = parent
        self._built = False

    def _respawn(self, why: str = "died") -> None:
        self.restarts += 1
        logger.error("%s worker %d (pid %s) %s; starting it again", self.kind, self.index, self.pid, why)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._conn.close()
        self._spawn()


# (the copy sent first, the process's device) -> what answers the batches
BuildFn = Callable[[Any, torch.device], Any]
# (what the copy built, a batch, the device) -> the answer
RunFn = Callable[[Any, Any, torch.device], Any]


def serve(build: BuildFn, run: RunFn) -> None:
    """The process's main: `python -m <module> <pipe fd> <device> <threads>`. Builds its part from the first
    message, then answers batches until told to stop (or the engine is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle: it stops us
    conn, device = Connection(int(sys.argv[1])), torch.device(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]))
    built = None
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        kind, payload = message
        try:
            with torch.inference_mode():
                if kind == "build":
                    built, answer = build(payload, device), None
                else:
                    answer = run(built, payload, device)
            reply = ("ok", answer)
        except Exception as e:  # noqa: BLE001 - the lane decides what a failed batch fails
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def same_gpu(a: torch.device, b: torch.device) -> bool:
    if a.type != "cuda" or b.type != "cuda":
        return False
    return (a.index if a.index is not None else torch.cuda.current_device()) == \
        (b.index if b.index is not None else torch.cuda.current_device())


def check_devices(devices: list[str], worker_device: torch.device, flag: str, where_else: str) -> None:
    """ValueError for a GPU this process does not see, or the worker's own GPU."""
    for device in devices:
        place = torch.device(device)
        if place.type == "cuda" and (place.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device!r}: this worker sees {torch.cuda.device_count()} GPU(s) (a Ray "
                             "worker sees those it was given)")
        if same_gpu(place, worker_device):
            raise ValueError(f"{flag} {device!r} is the worker's own GPU ({worker_device}): its processes go to the "
                             f"CPU or another GPU ({where_else})")
