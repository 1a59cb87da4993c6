"""The threads behind a stage of the worker (encode, decode): one per lane (most stages have one), each started
when work is handed over and ended when there is none (an idle stage holds no thread, nor through it the
model), each on a CUDA stream of its own, and replaced if it dies, the new thread taking over what the dead one
had taken first: nothing handed over is lost. Lanes take batches off one queue (the decode stage has one per
decode worker process).

A stage subclasses it with its queue (`_jobs`) and four parts: `_take` (the next batch, under the lock),
`_work` (that batch and its lane, outside it), `_finish` (its result, under the lock) and `_requeue` (a dead
thread's batch).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Collection

import torch

logger = logging.getLogger(__name__)

_JOIN_POLL_S = 0.1


class StageThread:
    kind = "stage"  # the thread is named dvllm-<kind>
    _jobs: Collection[Any]

    def __init__(self, device: torch.device, lanes: int = 1) -> None:
        self.device = device
        self._streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(lanes)]
        self._cond = threading.Condition()
        self._taken_by: dict[int, list[Any]] = {}  # lane -> the batch its thread is on
        self._threads: dict[int, threading.Thread] = {}  # lane -> its thread, while it has work
        self.restarts = 0

    @property
    def _stream(self) -> torch.cuda.Stream | None:
        return self._streams[0]

    @property
    def _taken(self) -> list[Any]:
        """What every lane's thread is on."""
        return [item for taken in self._taken_by.values() for item in taken]

    # -- for the stage's loop-side methods, under self._cond --------------------------------
    def _wake(self) -> None:
        """Starts threads on idle lanes, one per job waiting beyond those the threads between batches will take."""
        idle = [lane for lane in range(len(self._streams)) if lane not in self._threads]
        between = len(self._threads) - len(self._taken_by)
        for lane in idle[:max(len(self._jobs) - between, 0)]:
            self._threads[lane] = self._start(lane)
        self._cond.notify_all()  # a lane waiting behind another's batch may take the new work

    def _revive(self) -> None:
        """A thread that died with work left: its batch goes back first, to a new thread."""
        dead = [lane for lane, thread in self._threads.items() if not thread.is_alive()]
        for lane in dead:
            self.restarts += 1
            taken = self._taken_by.pop(lane, [])
            logger.error("a %s thread died; a new one takes over its %d item(s)", self.kind,
                         len(self._jobs) + len(taken))
            self._requeue(taken)
            del self._threads[lane]
        if dead:
            self._wake()  # (which wakes lanes waiting behind the dead one's batch)

    def _join(self) -> None:
        """Waits (not holding the lock) for the threads to run out of work."""
        while True:
            with self._cond:
                self._revive()
                threads = list(self._threads.values())
            if not threads:
                return
            for thread in threads:  # (a bounded wait: a lane may wait behind a dead one's batch, which _revive frees)
                thread.join(_JOIN_POLL_S)

    # -- the thread ----------------------------------------------------------------------------
    def _start(self, lane: int) -> threading.Thread:
        name = f"dvllm-{self.kind}" if len(self._streams) == 1 else f"dvllm-{self.kind}-{lane}"
        thread = threading.Thread(target=self._run, args=(lane,), name=name, daemon=True)
        thread.start()
        return thread

    def _run(self, lane: int) -> None:
        # No torch.set_num_threads here: besides this thread's OpenMP count it resizes process-wide thread pools
        # the loop may be using at that moment (seen to crash it)
        stream = self._streams[lane]
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            while True:
                with self._cond:
                    taken = self._take() if self._jobs else []
                    while self._jobs and not taken:  # what is left waits behind batches other lanes are on
                        self._cond.wait()
                        taken = self._take() if self._jobs else []
                    if not taken:
                        del self._threads[lane]
                        return
                    self._taken_by[lane] = taken
                start = time.perf_counter()
                result = self._work(taken, lane)
                with self._cond:
                    self._finish(taken, result, time.perf_counter() - start)
                    del self._taken_by[lane]
                    self._cond.notify_all()

    def _take(self) -> list[Any]:
        """The next batch ([]: the jobs left must wait for batches other lanes are on)."""
        raise NotImplementedError

    def _work(self, taken: list[Any], lane: int) -> Any:
        raise NotImplementedError

    def _finish(self, taken: list[Any], result: Any, seconds: float) -> None:
        raise NotImplementedError

    def _requeue(self, taken: list[Any]) -> None:
        raise NotImplementedError
