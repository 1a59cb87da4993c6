"""A stage's worker process (a decode worker, an encode worker, a group member): a remote of dvllm's runtime
(runtime/remote.py) that builds its part of the model from a copy sent to it first, then answers one batch at a
time.

The lane thread that owns it sends a batch and waits for the answer. A process found dead, or past its call's
bound (a process that lives but does not answer: stopped, wedged in a driver, deadlocked; the runtime's watchdog
kills it), is started again and WorkerProcessLost is raised to the lane, which sends the batch once more: no
request is lost to a killed process. The call in flight's age is the process's heartbeat (`health`), which
/health and the metrics report.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dvllm.runtime.backends import Backend
from dvllm.runtime.calls import answer_calls
from dvllm.runtime.channel import Channel
from dvllm.runtime.errors import ProcessLost
from dvllm.runtime.remote import SETUP, Remote


class WorkerProcessLost(ProcessLost):
    """The stage's process died (killed, or crashed) or passed its call's bound before answering."""


class StageProcess(Remote):
    """One process; used by one lane thread at a time."""

    kind = "stage"  # named in logs: "<kind> worker 0"
    target = ""  # the "module:function" the process runs (it calls serve())
    process_name = "dvllm-stage"  # its /proc/PID/comm
    lost_error = WorkerProcessLost

    def __init__(self, copy: Callable[[], Any], device: str, threads: int, index: int,
                 backend: Backend | None = None) -> None:
        self._copy = copy  # what the process builds its part from, sent first to each process started
        self.device, self.threads, self.index = device, threads, index
        # its OpenMP threads sleep between batches instead of spinning on cores the worker's threads use
        super().__init__(f"{self.kind} worker {index}", self.target, self.process_name, [device], threads,
                         {"OMP_WAIT_POLICY": "PASSIVE"}, backend)

    def call(self, batch: Any) -> Any:
        """The process's answer to `batch`; raises RuntimeError with the process's error, or WorkerProcessLost
        (the process is started again before it is raised)."""
        if not self._built:
            super().call(SETUP, self._copy())
            self._built = True
        return super().call("run", batch)

    def _started(self) -> None:
        self._built = False


# (the copy sent first, the process's device) -> what answers the batches
BuildFn = Callable[[Any, torch.device], Any]
# (what the copy built, a batch, the device) -> the answer
RunFn = Callable[[Any, Any, torch.device], Any]


def serve(channel: Channel, device: str, build: BuildFn, run: RunFn) -> None:
    """The process's loop: builds its part from the first call, then answers batches until told to stop (or the
    engine is gone)."""
    place, built = torch.device(device), None

    def handle(kind: str, payload: Any) -> Any:
        nonlocal built
        with torch.inference_mode():
            if kind == SETUP:
                built = build(payload, place)
                return None
            return run(built, payload, place)

    answer_calls(channel, handle)


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
