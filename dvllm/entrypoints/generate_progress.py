"""`dvllm generate`'s loop: requests through the engine's add_request/step, a progress bar counted in
denoising steps (a bar by request sits at 0/1 for the whole run of one big image), and Ctrl-C that
stops at the next step instead of tearing through a forward pass."""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from dvllm.core.request import Request
from dvllm.errors import QueueFullError
from dvllm.outputs import RequestMetrics, RequestOutput


class StepProgress:
    """A tqdm bar over the denoising steps of every request together, with images/s (a video model's: videos/s);
    or nothing."""

    def __init__(self, requests: list[Request], enabled: bool, noun: str = "images") -> None:
        self._rate_name = f"{noun}_per_s"
        self._expected = {r.request_id: r.params.num_inference_steps for r in requests}
        self._counted = dict.fromkeys(self._expected, 0)
        self._images = 0
        self._start = time.perf_counter()
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=sum(self._expected.values()), desc="Generating", unit="step")

    def update(self, out: RequestOutput) -> None:
        expected = self._expected.get(out.request_id)
        if expected is None:
            return
        if out.num_inference_steps != expected:  # the engine planned another count (e.g. img2img strength)
            self._retotal(out.num_inference_steps - expected)
            self._expected[out.request_id] = expected = out.num_inference_steps
        # A finished request counts all its steps, so failed ones still bring the bar to its end.
        target = expected if out.finished else min(out.num_steps_done, expected)
        delta = target - self._counted[out.request_id]
        if out.finished:
            self._images += len(out.images)
        if delta > 0:
            self._counted[out.request_id] = target
            if self._bar is not None:
                self._bar.update(delta)
        if out.finished and self._bar is not None:
            self._bar.set_postfix({self._rate_name: f"{self._images / (time.perf_counter() - self._start):.2f}"})

    def _retotal(self, change: int) -> None:
        if self._bar is not None:
            self._bar.total += change
            self._bar.refresh()

    def print(self, line: str, file: TextIO | None = None) -> None:
        """A line on stdout (or `file`), right away (for pipes too), without breaking the bar."""
        file = file or sys.stdout
        if self._bar is None:
            print(line, file=file, flush=True)
            return
        self._bar.write(line, file=file)
        file.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_requests(engine: Any, requests: list[Request], on_finished: Callable[[RequestOutput], None],
                 progress: StepProgress, stop: threading.Event) -> bool:
    """Runs `requests` on a DiffusionEngine through its low-level loop; on_finished gets each final output
    as soon as it is there. Admission stays bounded as in engine.generate: a request is added only while
    fewer than max_num_waiting wait. Returns False when `stop` was set (checked between steps)."""
    pending = list(reversed(requests))
    ours = {r.request_id for r in requests}
    remaining = len(ours)
    while remaining:
        if stop.is_set():
            return False
        for failed in _admit(engine, pending):
            remaining -= 1
            progress.update(failed)
            on_finished(failed)
        if not remaining:
            break
        for out in engine.step():
            progress.update(out)
            if out.finished and out.request_id in ours:
                remaining -= 1
                on_finished(out)
    return True


def _admit(engine: Any, pending: list[Request]) -> list[RequestOutput]:
    """Adds pending requests (made by the engine's input processor: checked once, before any was queued)
    while the waiting queue has room; ones the engine refuses come back as failed."""
    failed = []
    limit = engine.config.max_num_waiting
    while pending and engine.stats()["num_waiting"] < limit:
        request = pending[-1]
        try:
            engine.add_processed(request)
        except QueueFullError:
            break  # counted differently than we see it; try again after the next step
        except ValueError as e:  # e.g. no live worker's pool holds it
            failed.append(_failed_output(request, str(e)))
        pending.pop()
    return failed


def _failed_output(request: Request, error: str) -> RequestOutput:
    return RequestOutput(request_id=request.request_id, prompt=request.prompt, seed=request.params.seed or 0,
                         num_inference_steps=request.params.num_inference_steps or 0, num_steps_done=0,
                         finished=True, metrics=RequestMetrics(arrival_time=time.time()), error=error)


@contextmanager
def stop_on_sigint(stop: threading.Event) -> Iterator[None]:
    """While inside: the first Ctrl-C sets `stop` (the loop ends after the running step, whose finished
    images are still written); a second one raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
