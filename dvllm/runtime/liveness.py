"""How dvllm tells a process that lives but does not answer (stopped, wedged in a driver, deadlocked) from one
that works, besides a dead one (which its channel's close says).

- A call's bound (CallBounds): a watchdog thread kills the process whose call passes it, whatever the caller is
  blocked in (waiting for the answer, or sending into the full pipe of a process that reads nothing), and the
  caller handles it as a death (remote.py).
- A heartbeat (Heartbeat): for a process that answers no calls but streams reports (the engine core's loop), a
  ping sent as one of its commands, which its loop answers between two steps, on the thread that steps: so the
  answer proves the loop turns. A thread of its own that beat would go on beating while the loop is stuck inside
  a step, and a stopped (SIGSTOP) or wedged process answers nothing at all. Every other report proves as much, so
  the age is the time since the last report of any kind. An idle loop is woken by the ping; a busy one answers
  after its step, so the bound must exceed the longest single step.
- Idle pings (IdlePings): for remotes that answer calls (a Ray worker), whose death while no call is in flight
  no call would notice: each idle one is sent a PING, a call whose bound is the heartbeat's; the remote answers in
  order, so an idle one answers at once, and one that does not within the bound is killed as any call's would be.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from dvllm.config import STAGE_CALL_TIMEOUT_S, STAGE_START_TIMEOUT_S
from dvllm.runtime.calls import PING
from dvllm.runtime.errors import ProcessLost
from dvllm.runtime.pending import Pending, wait

logger = logging.getLogger(__name__)


class Killable(Protocol):
    def kill(self) -> None: ...


@dataclass(frozen=True)
class CallBounds:
    """How long a call may wait for its answer before the process is taken for lost: `start_s` for the calls of a
    process that has not answered a batch yet (it imports torch, builds its part from the copy sent first, warms
    up on its first batch), `call_s` for every later one."""

    call_s: float = STAGE_CALL_TIMEOUT_S
    start_s: float = STAGE_START_TIMEOUT_S


class Watchdog:
    """Kills a process whose call passes its deadline. A thread of its own, so that it acts whatever the caller is
    blocked in: once the process is gone, its channel call fails or its wait sees the death."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, Killable] | None = None  # (deadline, the process the call went to)
        self._closed = False
        self.fired = False  # the last call armed passed its deadline and its process was killed
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def arm(self, seconds: float, process: Killable) -> None:
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


_PING_S = 1.0  # how often the loop is pinged (less with a bound under 4 s)


class Heartbeat:
    """Pings the loop through `ping` (which must not block) from a thread of its own once started; `seen` is
    called with every report the loop sends. Past `limit_s` without one the process is unresponsive: logged
    once (naming it as `what`, its bound as the option `setting`, and `meanwhile`: what is refused until it
    answers), counted in `stalls`, and logged again when it answers."""

    def __init__(self, ping: Callable[[], None], limit_s: float, what: str, setting: str, meanwhile: str = "",
                 thread_name: str = "dvllm-heartbeat") -> None:
        self.limit_s = limit_s
        self._what, self._setting, self._meanwhile, self._thread_name = what, setting, meanwhile, thread_name
        self.stalls = 0
        self._ping = ping
        self._interval = min(_PING_S, limit_s / 4)
        self._last = time.monotonic()  # the loop's latest report
        self._pinged: float | None = None  # when the ping not answered yet was sent
        self._stalled = False
        self._lock = threading.Lock()  # (the thread and callers both watch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._last = time.monotonic()  # loading is not serving: the clock starts with the serving
            self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def seen(self) -> None:
        """The loop reported something: it came round."""
        self._last = time.monotonic()
        self._pinged = None

    @property
    def age(self) -> float:
        """Seconds since the loop's latest report."""
        return time.monotonic() - self._last

    @property
    def responsive(self) -> bool:
        """Whether the loop reported within the bound (a stall is counted by whoever sees it first: the thread
        or a caller)."""
        return self._watch()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            # One ping in flight at a time (sent again once per bound): a frozen process's pipe does not fill up
            if self._pinged is None or now - self._pinged > self.limit_s:
                self._pinged = now
                try:
                    self._ping()
                except Exception:  # noqa: BLE001 - a process gone is the exit path's to report, not this thread's
                    logger.debug("pinging %s failed", self._what, exc_info=True)
            self._watch()

    def _watch(self) -> bool:
        """Whether the loop is responsive; logs and counts the change when it is not what it was."""
        responsive = self.age <= self.limit_s
        with self._lock:
            if responsive == self._stalled:
                self._stalled = not responsive
                self.stalls += not responsive
                if responsive:
                    logger.warning("%s answers again", self._what)
                else:
                    logger.error("%s has answered nothing for %.1f s (%s=%g)%s", self._what, self.age, self._setting,
                                 self.limit_s, self._meanwhile)
        return responsive


class IdlePings:
    """The heartbeat of call-answering remotes between their calls, run by the caller's own loop (`check`, every
    interval it chooses): no thread, since the caller's loop is what takes the answers."""

    def __init__(self, limit_s: float) -> None:
        if limit_s <= 0:
            raise ValueError(f"a heartbeat's bound must be > 0 s, not {limit_s}")
        self.limit_s = limit_s
        self._pings: dict[Hashable, Pending] = {}  # the ping out to each remote (by the caller's key)

    def check(self, remotes: Mapping[Hashable, Any], busy: Collection[Hashable] = ()) -> dict[Hashable, str]:
        """Pings each of `remotes` (key -> remote with `submit`) not in `busy` with no ping out; takes the pings
        answered or failed. Returns the remotes found lost (key -> why): a ping that failed, or passed its
        bound (the remote is killed); one to a remote started again since it was sent says nothing."""
        for key in [key for key, ping in self._pings.items() if remotes.get(key) is not ping.remote]:
            del self._pings[key]  # (a remote given up, or replaced)
        lost: dict[Hashable, str] = {}
        for key, remote in remotes.items():
            if key not in self._pings and key not in busy:
                try:
                    self._pings[key] = remote.submit(PING, None, bound=self.limit_s)
                except ProcessLost as e:  # found lost already
                    lost[key] = str(e)
        return {**self._take(remotes), **lost}

    def _take(self, remotes: Mapping[Hashable, Any]) -> dict[Hashable, str]:
        done = set(wait(self._pings.values(), timeout=0))
        lost: dict[Hashable, str] = {}
        for key, ping in list(self._pings.items()):
            if ping not in done:
                continue
            del self._pings[key]
            try:
                ping.result()
            except ProcessLost as e:
                if ping.incarnation == remotes[key].restarts:  # (not a ping to the process before a restart)
                    lost[key] = str(e)
        return lost
