"""CoreLoop: the async engine's step loop around one DiffusionEngine, wherever it runs.

Commands (add a processed request, abort one) arrive from any thread and are applied between
steps; everything the loop has to say leaves through one `report` callable as a small tuple:

    ("accepted", request_id, error or None)   an add was applied (error: what add_processed raised)
    ("step", StepStats, outputs, stats)        a step ran
    ("stats", stats)                           the counters changed while idle (commands, worker polls)
    ("pong",)                                  the answer to a ping: the loop came round (runtime/liveness.py)

The same loop runs on a thread of the server's process (the report goes to the event loop) and as
the main loop of an engine core process (the report goes down its channel): see core_process.py.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from dvllm.engine.engine import DiffusionEngine
from dvllm.runtime.errors import portable

logger = logging.getLogger(__name__)

Report = Callable[[tuple], None]


class CoreLoop:
    def __init__(self, engine: DiffusionEngine, report: Report) -> None:
        self.engine = engine
        self._report = report
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._stats: dict | None = None

    def put(self, *command: Any) -> None:
        """("add", Request), ("abort", request_id, reason or None) or ("ping",); thread-safe, applied before the
        next step."""
        self._commands.put(command)
        self._wakeup.set()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()

    def run(self) -> None:
        """Steps while there is work, until stop(); raises what broke the engine (the caller reports it)."""
        engine = self.engine
        self._send_stats()
        while not self._stop.is_set():
            self._apply_commands()
            if not engine.has_unfinished_requests():
                # idle, yet a restarted worker must be let in, and a dead one noticed
                interval = engine.idle_poll_interval
                self._wakeup.wait(interval)
                self._wakeup.clear()
                if interval is not None:
                    engine.poll_workers()
                self._send_stats()
                continue
            outputs = engine.step()
            self._stats = self.stats()
            self._report(("step", engine.last_step, outputs, self._stats))

    def stats(self) -> dict:
        return {**self.engine.stats(), "workers": self.engine.worker_stats()}

    def _send_stats(self) -> None:
        stats = self.stats()
        if stats != self._stats:
            self._stats = stats
            self._report(("stats", stats))

    def _apply_commands(self) -> None:
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "ping":  # answered here, between steps, by the thread that steps
                self._report(("pong",))
                continue
            applied = True
            if command[0] == "add":
                request = command[1]
                try:
                    self.engine.add_processed(request)
                except Exception as e:  # bad input or a full queue: the caller's error
                    self._report(("accepted", request.request_id, portable(e)))
                else:
                    self._report(("accepted", request.request_id, None))
            else:
                _, request_id, reason = command
                if self.engine.abort_request(request_id) and reason:
                    logger.info("aborted %s: %s", request_id, reason)
        if applied:
            self._send_stats()

