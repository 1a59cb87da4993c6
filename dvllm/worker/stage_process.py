"""A stage's worker process (a decode worker, an encode worker, a group member): a process of its own that builds
its part of the model from a copy sent to it first, then answers one batch at a time over a pipe.

A process is started as the engine core process is (forked by the fork server, or a fresh interpreter, running
`<module>.main` and dying with its parent: fork_server.py; never a fork of a process that holds CUDA or threads,
and not multiprocessing's spawn, which imports the caller's main script again). The lane thread that owns it
sends a batch and waits for the answer, checking now and then that the process lives; one found dead is spawned again and WorkerProcessLost is raised to
the lane, which sends the batch once more: no request is lost to a killed process.

A process that lives but does not answer (stopped, wedged in a driver, deadlocked) is lost too: each call has a
bound (CallBounds), past which a watchdog kills the process, whatever the lane is blocked in (waiting for the
answer, or sending into the full pipe of a process that reads nothing), and the lane handles it as a death. The
call in flight's age is the process's heartbeat (`health`), which /health and the metrics report.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from dvllm.config import STAGE_CALL_TIMEOUT_S, STAGE_START_TIMEOUT_S
from dvllm.fork_server import Child, start_child
from dvllm.logging_setup import child_library_logs, set_third_party_verbosity

logger = logging.getLogger(__name__)

# How often a lane waiting for its process checks that the process is still alive
_ALIVE_POLL_S = 1.0
_CLOSE_TIMEOUT_S = 10.0


class WorkerProcessLost(RuntimeError):
    """The stage's process died (killed, or crashed) or passed its call's bound before answering."""


@dataclass(frozen=True)
class CallBounds:
    """How long a call may wait for its answer before the process is taken for lost: `start_s` for the calls of a
    process that has not answered a batch yet (it imports torch, builds its part from the copy sent first, warms
    up on its first batch), `call_s` for every later one."""

    call_s: float = STAGE_CALL_TIMEOUT_S
    start_s: float = STAGE_START_TIMEOUT_S


class _Watchdog:
    """Kills a process whose call passes its deadline. A thread of its own, so that it acts whatever the lane is
    blocked in: once the process is gone, the lane's pipe call fails or its wait sees the death."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, Child] | None = None  # (deadline, the process the call went to)
        self._closed = False
        self.fired = False  # the last call armed passed its deadline and its process was killed
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def arm(self, seconds: float, process: Child) -> None:
        with self._cond:
            self._armed, self.fired = (time.monotonic() + seconds, process), False
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed, self.fired = None, False  # (no notify: the thread finds it so at the deadline it waits for)

    def close(self) -> None:
        with self._cond:
            self._closed, self._armed = True, None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, process = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed, self.fired = None, True
                process.kill()  # (SIGKILL ends a stopped process too)


class StageProcess:
    """One process and the pipe to it; used by one lane thread at a time."""

    kind = "stage"  # named in logs: "<kind> worker 0"
    module = ""  # the module whose main() the process runs (it calls serve())
    process_name = "dvllm-stage"  # its /proc/PID/comm

    def __init__(self, copy: Callable[[], Any], device: str, threads: int, index: int) -> None:
        self._copy = copy  # what the process builds its part from, sent first to each process started
        self.device, self.threads, self.index = device, threads, index
        self.restarts = 0
        self.timeouts = 0  # calls that passed their bound (each also counts as a restart)
        self.bounds = CallBounds()  # set by whoever starts it, from the engine's config
        self._process: Child | None = None
        self._conn: Connection | None = None
        self._built = False
        self._answered = False  # a batch was answered since the process started: later calls have call_s
        self._call: tuple[float, float, str] | None = None  # the call in flight: (when it was sent, its bound, kind)
        self._watchdog = _Watchdog(f"dvllm-{self.kind.replace(' ', '-')}-watchdog-{index}")
        self._spawn()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def call(self, batch: Any) -> Any:
        """The process's answer to `batch`; raises RuntimeError with the process's error, or WorkerProcessLost
        (the process is spawned again before it is raised)."""
        try:
            if not self._built:
                self._exchange(("build", self._copy()))
                self._built = True
            return self._exchange(("run", batch))
        except (EOFError, OSError, WorkerProcessLost) as e:
            pid, lost = self.pid, self._lost(f"died: {type(e).__name__}")
            self._respawn()
            raise WorkerProcessLost(f"{self.kind} worker {self.index} (pid {pid}) {lost}") from None

    def health(self) -> dict[str, Any]:
        """The process's heartbeat: its pid, how long its call in flight has waited (None: idle) and that call's
        bound (idle: the next call's), its restarts and timeouts so far. Read from any thread."""
        call = self._call
        if call is None:
            return {"pid": self.pid, "call_age_s": None, "limit_s": self._bound(), "restarts": self.restarts,
                    "timeouts": self.timeouts}
        return {"pid": self.pid, "call_age_s": round(time.monotonic() - call[0], 3), "limit_s": call[1],
                "restarts": self.restarts, "timeouts": self.timeouts}

    def close(self) -> None:
        self._watchdog.close()
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

    def _exchange(self, message: tuple[str, Any]) -> Any:
        self._send(message)
        return self._receive()

    def _send(self, message: tuple[str, Any]) -> None:
        """Sends a message and starts its call's clock: the watchdog kills the process past the call's bound."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        bound = self._bound()
        self._call = (time.monotonic(), bound, message[0])
        self._watchdog.arm(bound, self._process)
        self._conn.send_bytes(data)

    def _bound(self) -> float:
        return self.bounds.call_s if self._answered else self.bounds.start_s

    def _receive(self) -> Any:
        """The answer to the message sent last; raises as `call` says (WorkerProcessLost: not spawned again)."""
        while not self._conn.poll(_ALIVE_POLL_S):
            if self._process.poll() is not None:
                raise WorkerProcessLost(self._lost("exited"))
        status, value = pickle.loads(self._conn.recv_bytes())
        self._watchdog.disarm()
        call, self._call = self._call, None
        if call is not None and call[2] == "run":
            self._answered = True  # (an error answered is an answer too: the process is up and warm)
        if status == "error":
            raise RuntimeError(value)
        return value

    def _lost(self, otherwise: str) -> str:
        """Why the process is lost: its call passed its bound (the watchdog killed it), or `otherwise`."""
        if not self._watchdog.fired:
            return otherwise
        bound = self._call[1] if self._call is not None else self.bounds.call_s
        return f"did not answer within {bound:g} s (the bound of its call) and was killed"

    def _spawn(self) -> None:
        parent, child = multiprocessing.Pipe()
        self._process = start_child(  # (it dies with this process, even while starting)
            f"{self.module}:main", self.process_name, [child.fileno()], [self.device, str(self.threads)],
            # its OpenMP threads sleep between batches instead of spinning on cores the worker's threads use
            {"OMP_WAIT_POLICY": "PASSIVE"})
        child.close()  # the child's end lives in the child alone: its death ends the pipe
        self._conn = parent
        self._built = self._answered = False

    def _respawn(self, why: str = "died") -> None:
        self.restarts += 1
        if self._watchdog.fired:
            self.timeouts += 1
            why = self._lost(why)
        self._watchdog.disarm()
        self._call = None
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
    """The process's main, with sys.argv[1:] = `<pipe fd> <device> <threads>`. Builds its part from the first
    message, then answers batches until told to stop (or the engine is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle: it stops us
    set_third_party_verbosity(verbose=child_library_logs())  # (its stderr is the engine's: no loading bars there)
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
