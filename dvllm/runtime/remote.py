"""A remote: a process (or, for tests, a thread: backends.py) that answers calls over a channel, and the caller's
end of it, used by one thread at a time. Owns what every one of dvllm's call-answering processes needs: the
start, call ids, each call's bound (a watchdog kills a process past it: liveness.py), the heartbeat /health reads
(the age of the oldest call in flight), the errors (the remote's own, as RemoteError; a death or a passed bound as
`lost_error`), and the start again after a loss. Redoing the lost call is the caller's: it knows whether the call
may run twice (a batch of pure calls) and what to send a new process first.

`call` sends a call and waits for its answer; `submit` sends one and returns its Pending (pending.py), so that
several may be in flight (the remote answers them in order) and `pending.wait` can wait across remotes.
"""
from __future__ import annotations

import itertools
import logging
import subprocess
import time
from collections import deque
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, NoReturn, Sequence

from dvllm.runtime.backends import Backend, Handle, ProcessBackend
from dvllm.runtime.calls import PING, Answer, Call
from dvllm.runtime.channel import Channel
from dvllm.runtime.errors import ProcessLost
from dvllm.runtime.liveness import CallBounds, Watchdog
from dvllm.runtime.pending import Pending, time_left

logger = logging.getLogger(__name__)

_ALIVE_POLL_S = 1.0  # how often a caller waiting for its answer checks that the remote still lives
_CLOSE_TIMEOUT_S = 10.0
SETUP = "build"  # a call that sets a remote up: its answer does not end the start bound (CallBounds.start_s)


class Remote:
    """One remote, named `label` in logs and errors ("decode worker 0"), that runs `target` ("module:function",
    called with its channel and `args`) with `threads` torch threads. Started at once."""

    lost_error: type[ProcessLost] = ProcessLost

    def __init__(self, label: str, target: str, name: str, args: Sequence[str] = (), threads: int = 0,
                 env: dict[str, str] | None = None, backend: Backend | None = None) -> None:
        self.label, self._target, self._name, self._args = label, target, name, tuple(args)
        self._threads, self._env = threads, env
        self._backend = backend or ProcessBackend()
        self.restarts = 0
        self.timeouts = 0  # calls that passed their bound (each also counts as a restart)
        self.bounds = CallBounds()  # set by whoever starts it, from the engine's config
        self._ids = itertools.count()
        self._process: Handle | None = None
        self._channel: Channel | None = None
        self._answered = False  # a call other than a setup was answered since the start: later calls have call_s
        self._calls: deque[Pending] = deque()  # sent, not answered yet, oldest first (the remote answers in order)
        self._answers: dict[int, Answer] = {}  # answered, not taken yet
        self._lost_why: str | None = None  # found lost (why), until started again
        self._last: Pending | None = None  # what `post` sent last
        self._watchdog = Watchdog(f"{label.replace(' ', '-')}-watchdog")
        self._start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def process(self) -> Handle | None:
        """The process (Popen's pid, poll, wait, kill), or None once closed."""
        return self._process

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def in_flight(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._calls)

    def call(self, kind: str, payload: Any) -> Any:
        """The remote's answer; raises its error (RemoteError, or the error itself where it pickles), or
        `lost_error` (the remote is started again before it is raised)."""
        try:
            return self.submit(kind, payload).result()
        except (EOFError, OSError, ProcessLost) as e:
            why = str(e) if isinstance(e, ProcessLost) else self._lost(f"died: {type(e).__name__}")
            self.restart()
            raise self.lost_error(why) from None

    def submit(self, kind: str, payload: Any, bound: float | None = None) -> Pending:
        """Sends a call and starts its clock (`bound` seconds, else the remote's CallBounds): the watchdog kills
        the process past the bound of the oldest call in flight. Raises `lost_error` if the remote is lost."""
        self._check()
        pending = Pending(self, next(self._ids), kind, self._bound() if bound is None else bound)
        self._calls.append(pending)
        if len(self._calls) == 1:
            self._watchdog.arm(pending.bound, self._process)
        try:
            self._channel.send(Call(pending.id, kind, payload))
        except (OSError, ValueError) as e:
            self._lose(f"died: {type(e).__name__}")
        return pending

    def post(self, kind: str, payload: Any) -> None:
        """Sends a call; `receive` waits for its answer."""
        self._last = self.submit(kind, payload)

    def receive(self) -> Any:
        """The answer to the call `post` sent last; raises as `call` says (`lost_error`: not started again)."""
        last, self._last = self._last, None
        if last is None:
            raise self.lost_error(f"{self._named()} has no call in flight to answer")
        return last.result()

    def health(self) -> dict[str, Any]:
        """The remote's heartbeat: its pid, how long its oldest call in flight has waited (None: idle) and that
        call's bound (idle: the next call's), its restarts and timeouts so far. Read from any thread."""
        call = self._calls[0] if self._calls else None
        age, limit = (None, self._bound()) if call is None else (round(call.age, 3), call.bound)
        return {"pid": self.pid, "call_age_s": age, "limit_s": limit, "restarts": self.restarts,
                "timeouts": self.timeouts}

    def restart(self, why: str = "died") -> None:
        """Ends the process (if it still lives) and starts another; the calls in flight are lost."""
        self.restarts += 1
        if self._watchdog.fired:
            self.timeouts += 1
        why = self._lost_why or self._lost(why)
        self._watchdog.disarm()
        logger.error("%s; starting it again", why)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._channel.close()
        self._start()

    def close(self) -> None:
        self._watchdog.close()
        if self._process is None:
            return
        try:
            self._channel.send(None)
        except (OSError, ValueError):
            pass
        try:
            self._process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._channel.close()
        self._process = self._channel = None

    # -- pending answers (pending.py) ----------------------------------------------
    def _ready(self, pending: Pending) -> bool:
        return pending.incarnation != self.restarts or pending.id in self._answers or self._lost_why is not None

    def _take(self, pending: Pending) -> Any:
        if pending.incarnation != self.restarts:
            raise self.lost_error(f"{self.label} was started again with call {pending.id} in flight")
        while pending.id not in self._answers:
            if pending not in self._calls:
                raise ValueError(f"{pending} was taken already")
            self._pump(_ALIVE_POLL_S)
        answer = self._answers.pop(pending.id)
        if answer.error is not None:
            raise answer.error
        return answer.value

    def _pump(self, timeout: float) -> bool:
        """Reads the next answer if one comes within `timeout` (whether one did); raises `lost_error` if the remote
        is lost."""
        self._check()
        if not self._channel.poll(timeout):
            if self._process.poll() is not None:
                self._lose("exited")
            return False
        try:
            answer: Answer = self._channel.receive()
        except (EOFError, OSError) as e:
            self._lose(f"died: {type(e).__name__}")
        if not self._calls or answer.id != self._calls[0].id:
            self._lose(f"answered call {answer.id}, not the call in flight")
        call = self._calls.popleft()
        if self._calls:  # the next call runs from now on
            self._watchdog.arm(self._calls[0].bound, self._process)
        else:
            self._watchdog.disarm()
        if call.kind not in (SETUP, PING):
            self._answered = True  # (an error answered is an answer too: the process is up and warm)
        self._answers[answer.id] = answer
        return True

    @staticmethod
    def _wait_any(pendings: list[Pending], timeout: float | None) -> list[Pending]:
        deadline = None if timeout is None else time.monotonic() + timeout
        remotes = list(dict.fromkeys(p.remote for p in pendings))
        while True:
            for remote in remotes:
                try:
                    while remote._pump(0):  # (every answer there)
                        pass
                except ProcessLost:  # (its pendings are done now: their result raises it)
                    pass
            done = [p for p in pendings if p.done()]
            left = time_left(deadline)
            if done or left == 0:
                return done
            live = [r._channel.conn for r in remotes if r._lost_why is None]
            wait_for_connections(live, min(_ALIVE_POLL_S, left or _ALIVE_POLL_S))

    # -- the rest -----------------------------------------------------------------
    def _check(self) -> None:
        if self._lost_why is not None:
            raise self.lost_error(self._lost_why)

    def _lose(self, otherwise: str) -> NoReturn:
        self._lost_why = self._lost(otherwise)  # (the watchdog stays as it is: `restart` counts a timeout)
        raise self.lost_error(self._lost_why)

    def _started(self) -> None:
        """After each start: what a subclass resets."""

    def _bound(self) -> float:
        return self.bounds.call_s if self._answered else self.bounds.start_s

    def _named(self) -> str:
        return f"{self.label} (pid {self.pid})"

    def _lost(self, otherwise: str) -> str:
        """Why the remote is lost: its call passed its bound (the watchdog killed it), or `otherwise`."""
        if not self._watchdog.fired:
            return f"{self._named()} {otherwise}"
        bound = self._calls[0].bound if self._calls else self.bounds.call_s
        return f"{self._named()} did not answer within {bound:g} s (the bound of its call) and was killed"

    def _start(self) -> None:
        self._process, self._channel = self._backend.start(self._target, self._name, self._args, self._threads,
                                                           self._env)
        self._answered = False
        self._calls.clear()
        self._answers.clear()
        self._lost_why = self._last = None
        self._started()
