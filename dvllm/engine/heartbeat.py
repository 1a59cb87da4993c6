"""The server's watch on the engine core's step loop: does it still come round?

A ping goes to the loop as a command, and the loop answers it between two steps, on the thread that steps
(core_loop.py): so the answer proves that the loop turns. A thread of the core's that beat on its own would go on
beating while the loop is stuck inside a step, and a stopped (SIGSTOP) or wedged process answers nothing at all.
Every other report of the loop's (a step's outputs, its counters) proves as much, so the core's age is the time
since its last report of any kind. An idle loop is woken by the ping; a busy one answers after its step, so the
bound must exceed the longest single step.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PING_S = 1.0  # how often the loop is pinged (less with a bound under 4 s)


class CoreHeartbeat:
    """Pings the loop through `ping` (which must not block) from a thread of its own once started; `seen` is
    called with every report the loop sends. Past `limit_s` without one the core is unresponsive: logged once,
    counted in `stalls`, and logged again when it answers."""

    def __init__(self, ping: Callable[[], None], limit_s: float) -> None:
        self.limit_s = limit_s
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
            self._thread = threading.Thread(target=self._run, name="dvllm-core-heartbeat", daemon=True)
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
            # One ping in flight at a time (sent again once per bound): a frozen core's pipe does not fill up
            if self._pinged is None or now - self._pinged > self.limit_s:
                self._pinged = now
                try:
                    self._ping()
                except Exception:  # noqa: BLE001 - a core gone is the exit path's to report, not this thread's
                    logger.debug("pinging the engine core failed", exc_info=True)
            self._watch()

    def _watch(self) -> bool:
        """Whether the loop is responsive; logs and counts the change when it is not what it was."""
        responsive = self.age <= self.limit_s
        with self._lock:
            if responsive == self._stalled:
                self._stalled = not responsive
                self.stalls += not responsive
                if responsive:
                    logger.warning("the engine core answers again")
                else:
                    logger.error("the engine core has answered nothing for %.1f s (core_heartbeat_timeout_s=%g): "
                                 "/health answers 503 and new requests are refused until it does", self.age,
                                 self.limit_s)
        return responsive
