"""What the harness measures inside an engine besides latencies, and how a contender's threads are set.

ForwardGaps times the step loop: the gap between two denoiser forwards (the end of one to the start of the next) is
the loop's own work between steps (scheduling, the sampler's update, the state's gather) plus whatever stalls it: a
text encode at admission, a decode of finished requests, the driver's work without async scheduling. A trace that
keeps the loop stepping (`--generate stall`) makes the longest gap the stall; where a trace lets the loop go idle,
the idle time between two forwards is a gap too. On CUDA each forward is waited for before and after, so work queued
on the loop's stream (an encode the host does not wait for) counts in the gap before it, not in the forward; that
takes away the overlap of the host's work with kernels in flight, so a run with the probe is not a throughput run.
"""
from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch


class ForwardGaps:
    """(start, end) of each denoiser forward of an engine whose worker runs in this process."""

    def __init__(self, adapter: Any) -> None:
        self.forwards: list[tuple[float, float]] = []
        self._lock = threading.Lock()  # with async scheduling the forwards run on the worker's thread
        sync = adapter.device.type == "cuda"
        real = adapter.denoise

        def timed(*args: Any, **kwargs: Any) -> Any:
            if sync:
                torch.cuda.current_stream().synchronize()
            start = time.perf_counter()
            out = real(*args, **kwargs)
            if sync:
                torch.cuda.current_stream().synchronize()
            with self._lock:
                self.forwards.append((start, time.perf_counter()))
            return out

        # the denoiser looks adapter.denoise up per call (eager, regional compile); a whole-forward compile
        # (compile dynamic or bucketed) bound it at start, and its forwards go untimed: no gaps are reported
        adapter.denoise = timed

    @classmethod
    def attach(cls, async_engine: Any) -> ForwardGaps | None:
        """The probe on an AsyncDiffusionEngine's in-process worker; None where the worker is elsewhere (a core
        process, Ray actors)."""
        worker = getattr(getattr(getattr(async_engine, "engine", None), "executor", None), "worker", None)
        return None if worker is None else cls(worker.runner.adapter)

    def take(self) -> dict[str, Any]:
        """The forwards since the last take: their count and gaps (seconds), and forget them."""
        with self._lock:
            forwards, self.forwards = self.forwards, []
        gaps = [b[0] - a[1] for a, b in zip(forwards, forwards[1:])]
        return {"forwards": len(forwards),
                "forward_gap_max_s": max(gaps) if gaps else None,
                "forward_gap_p50_s": statistics.median(gaps) if gaps else None,
                "forward_gap_mean_s": statistics.fmean(gaps) if gaps else None,
                "forward_mean_s": statistics.fmean(b - a for a, b in forwards) if forwards else None}


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside (None: as they are): around a contender's build (a worker
    group's members take as many threads as their leader; Ray workers take worker_num_cpus) and its runs."""
    if threads is None:
        yield
        return
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
