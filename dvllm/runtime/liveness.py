"""How dvllm tells a process that lives but does not answer (stopped, wedged in a driver, deadlocked) from one
that works, besides a dead one (which its channel's close says).

- A call's bound (CallBounds): a watchdog thread kills the process whose call passes it, whatever the caller is
  blocked in (waiting for the answer, or sending into the full pipe of a process that reads nothing), and the
  caller handles it as a death (remote.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from dvllm.config import STAGE_CALL_TIMEOUT_S, STAGE_START_TIMEOUT_S

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

