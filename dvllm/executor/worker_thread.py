"""The in-process worker on a thread of its own ("dvllm-worker"), for async scheduling: calls run one at a time
in the order they were made, so the driver can queue the next step while this one runs and every other call
(statistics, LoRA registry, shutdown) lands between steps, as it would without the thread.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class WorkerThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dvllm-worker", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues fn(*args) after the calls made before it; its result (or error) comes in the future."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        """Returns once the calls queued so far are done."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - it belongs to the caller, who gets it from the future
                future.set_exception(e)
