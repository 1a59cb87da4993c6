"""A remote: a process (or, for tests, a thread: backends.py) that answers calls over a channel, and the caller's
end of it, used by one thread at a time. Owns what every one of dvllm's call-answering processes needs: the
start, call ids, each call's bound (a watchdog kills a process past it: liveness.py), the heartbeat /health reads
(the age of the call in flight), the errors (the remote's own, as RemoteError; a death or a passed bound as
`lost_error`), and the start again after a loss. Redoing the lost call is the caller's: it knows whether the call
may run twice (a batch of pure calls) and what to send a new process first.
"""
from __future__ import annotations

import itertools
import logging
import subprocess
import time
from typing import Any, Sequence

from dvllm.runtime.backends import Backend, Handle, ProcessBackend
from dvllm.runtime.calls import Answer, Call
from dvllm.runtime.channel import Channel
from dvllm.runtime.errors import ProcessLost
from dvllm.runtime.liveness import CallBounds, Watchdog

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
        self._call: tuple[Call, float, float] | None = None  # the call in flight, when it was sent, its bound
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

    def call(self, kind: str, payload: Any) -> Any:
        """The remote's answer; raises its error (RemoteError, or the error itself where it pickles), or
        `lost_error` (the remote is started again before it is raised)."""
        try:
            self.post(kind, payload)
            return self.receive()
        except (EOFError, OSError, ProcessLost) as e:
            why = str(e) if isinstance(e, ProcessLost) else self._lost(f"died: {type(e).__name__}")
            self.restart()
            raise self.lost_error(why) from None

    def post(self, kind: str, payload: Any) -> None:
        """Sends a call and starts its clock: the watchdog kills the process past the call's bound."""
        call = Call(next(self._ids), kind, payload)
        bound = self._bound()
        self._call = (call, time.monotonic(), bound)
        self._watchdog.arm(bound, self._process)
        self._channel.send(call)

    def receive(self) -> Any:
        """The answer to the call sent last; raises as `call` says (`lost_error`: not started again)."""
        while not self._channel.poll(_ALIVE_POLL_S):
            if self._process.poll() is not None:
                raise self.lost_error(self._lost("exited"))
        answer: Answer = self._channel.receive()
        self._watchdog.disarm()
        call, self._call = self._call, None
        if call is None or answer.id != call[0].id:
            raise self.lost_error(f"{self._named()} answered call {answer.id}, not the call in flight")
        if call[0].kind != SETUP:
            self._answered = True  # (an error answered is an answer too: the process is up and warm)
        if answer.error is not None:
            raise answer.error
        return answer.value

    def health(self) -> dict[str, Any]:
        """The remote's heartbeat: its pid, how long its call in flight has waited (None: idle) and that call's
        bound (idle: the next call's), its restarts and timeouts so far. Read from any thread."""
        call = self._call
        age, limit = (None, self._bound()) if call is None else (round(time.monotonic() - call[1], 3), call[2])
        return {"pid": self.pid, "call_age_s": age, "limit_s": limit, "restarts": self.restarts,
                "timeouts": self.timeouts}

    def restart(self, why: str = "died") -> None:
        """Ends the process (if it still lives) and starts another."""
        self.restarts += 1
        if self._watchdog.fired:
            self.timeouts += 1
        why = self._lost(why)
        self._watchdog.disarm()
        self._call = None
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
        bound = self._call[2] if self._call is not None else self.bounds.call_s
        return f"{self._named()} did not answer within {bound:g} s (the bound of its call) and was killed"

    def _start(self) -> None:
        self._process, self._channel = self._backend.start(self._target, self._name, self._args, self._threads,
                                                           self._env)
        self._answered = False
        self._started()
