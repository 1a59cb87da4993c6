"""The thread behind a stage of the worker (encode, decode): it starts when work is handed over, ends when there
is none (an idle stage holds no thread, nor through it the model), runs on a CUDA stream of its own, and is
replaced if it dies, the new thread taking over what the dead one had taken first: nothing handed over is lost.

A stage subclasses it with its queue (`_jobs`) and four parts: `_take` (the next batch, under the lock),
`_work` (that batch, outside it), `_finish` (its result, under the lock) and `_requeue` (a dead thread's batch).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Collection

import torch

logger = logging.getLogger(__name__)


class StageThread:
    kind = "stage"  # the thread is named dvllm-<kind>
    _jobs: Collection[Any]

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cond = threading.Condition()
        self._taken: list[Any] = []  # the batch the thread is on
        self._thread: threading.Thread | None = None
        self.restarts = 0

    # -- for the stage's loop-side methods, under self._cond --------------------------------
    def _wake(self) -> None:
        """Starts the thread if there is work and none runs."""
        if self._thread is None and self._jobs:
            self._thread = self._start()

    def _revive(self) -> None:
        """A thread that died with work left: its batch goes back first, to a new thread."""
        if self._thread is None or self._thread.is_alive():
            return
        self.restarts += 1
        logger.error("the %s thread died; a new one takes over its %d item(s)", self.kind,
                     len(self._jobs) + len(self._taken))
        self._requeue(self._taken)
        self._taken = []
        self._thread = None
        self._wake()

    def _join(self) -> None:
        """Waits (not holding the lock) for the thread to run out of work."""
        with self._cond:
            self._revive()
            thread = self._thread
        if thread is not None:
            thread.join()

    # -- the thread ----------------------------------------------------------------------------
    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"dvllm-{self.kind}", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        # No torch.set_num_threads here: besides this thread's OpenMP count it resizes process-wide thread pools
        # the loop may be using at that moment (seen to crash it)
        with torch.inference_mode(), torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            while True:
                with self._cond:
                    if not self._jobs:
                        self._thread = None
                        return
                    self._taken = self._take()
                start = time.perf_counter()
                result = self._work(self._taken)
                with self._cond:
                    self._finish(self._taken, result, time.perf_counter() - start)
                    self._taken = []
                    self._cond.notify_all()

    def _take(self) -> list[Any]:
        raise NotImplementedError

    def _work(self, taken: list[Any]) -> Any:
        raise NotImplementedError

    def _finish(self, taken: list[Any], result: Any, seconds: float) -> None:
        raise NotImplementedError

    def _requeue(self, taken: list[Any]) -> None:
        raise NotImplementedError
