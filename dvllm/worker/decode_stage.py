"""Decode as a stage of its own: finished latents (and previews' x0 estimates) go to a thread of the worker's,
which runs the VAE (on a CUDA stream of its own) and the conversion to the output type, so the denoise loop
never waits for a decode.

The loop hands over a private copy of the latents (gathered out of the pool, so their blocks are free at
once) and collects what is done at its next iteration; a finished request's output comes at most one step
later than an in-loop decode's, with the same pixels (the same VAE calls on the same latents). A decode that
fails fails its own requests only (a batched call that raises is retried job by job). If the thread itself
dies, a new one takes over its jobs, the one it was on included: nothing that was handed over is lost.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dvllm.worker.stage_thread import StageThread

logger = logging.getLogger(__name__)

# (latents [n, ...] on the device, (height, width)) -> images [n, 3, H, W] in [0, 1]
DecodeFn = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]
# (images [n, 3, H, W] in [0, 1], output type) -> the request's images
ConvertFn = Callable[[torch.Tensor, str], list[Any]]


@dataclass(eq=False)
class DecodeJob:
    request_id: str
    latents: torch.Tensor  # [n, *latent shape], the job's own
    size: tuple[int, int]  # (height, width)
    output_type: str
    preview: bool = False  # an x0 estimate's preview, not the final images
    step: int = 0  # the step count its latents are from
    ready: Any = None  # a CUDA event the latents' copy recorded (None on the CPU)

    @property
    def n(self) -> int:
        return self.latents.shape[0]


@dataclass
class Decoded:
    """What the stage finished since the last collect."""

    images: dict[str, list[Any]] = field(default_factory=dict)
    previews: dict[str, list[Any]] = field(default_factory=dict)
    preview_steps: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # the thread's time decoding them, and the images it decoded (for the stage metrics)
    num_images: int = 0

    def merge(self, other: Decoded) -> None:
        self.images.update(other.images)
        self.previews.update(other.previews)
        self.preview_steps.update(other.preview_steps)
        self.errors.update(other.errors)
        self.seconds += other.seconds
        self.num_images += other.num_images


class DecodeStage(StageThread):
    kind = "decode"

    def __init__(self, decode: DecodeFn, convert: ConvertFn, device: torch.device, max_batch: int,
                 capacity: int) -> None:
        super().__init__(device)
        self._decode, self._convert = decode, convert
        self.max_batch, self.capacity = max_batch, capacity
        self._jobs: deque[DecodeJob] = deque()
        self._done = Decoded()

    # -- the loop's side -----------------------------------------------------------------
    def has_room(self, images: int) -> bool:
        """Whether `images` more fit the bound on images waiting (past it the loop decodes them itself)."""
        with self._cond:
            return self._queued_images() + images <= self.capacity

    def submit(self, jobs: list[DecodeJob]) -> None:
        if self._stream is not None:
            for job in jobs:  # the copy was made on the loop's stream: the decode stream waits for it
                job.ready = torch.cuda.Event()
                job.ready.record()
                job.latents.record_stream(self._stream)
        with self._cond:
            self._jobs.extend(jobs)
            self._wake()

    def collect(self, timeout: float = 0.0) -> Decoded:
        """What is done; with a timeout, waits up to it for something to be (while jobs are pending)."""
        with self._cond:
            self._revive()
            if timeout > 0 and self._empty_done() and self.pending:
                self._cond.wait(timeout)
            done, self._done = self._done, Decoded()
        return done

    @property
    def pending(self) -> int:
        """Jobs handed over and not yet collected as done."""
        return len(self._jobs) + len(self._taken)

    def drop(self, request_ids: set[str]) -> None:
        """Forgets queued jobs of requests that are gone (aborted, or their worker state freed)."""
        with self._cond:
            self._jobs = deque(j for j in self._jobs if j.request_id not in request_ids)

    def close(self, drain: bool = True) -> None:
        """Returns once the thread is done: after the jobs handed over are decoded (`drain`), or after the one
        it is on (their results stay to collect)."""
        with self._cond:
            if not drain:
                self._jobs.clear()
        self._join()

    # -- the thread's side -----------------------------------------------------------------
    def _work(self, taken: list[DecodeJob]) -> Decoded:
        return self._decode_jobs(taken)

    def _finish(self, taken: list[DecodeJob], result: Decoded, seconds: float) -> None:
        result.seconds, result.num_images = seconds, sum(job.n for job in taken)
        self._done.merge(result)

    def _requeue(self, taken: list[DecodeJob]) -> None:
        self._jobs.extendleft(reversed(taken))

    def _take(self) -> list[DecodeJob]:
        """The first job, and those after it of the same size and kind, up to max_batch images."""
        first = self._jobs.popleft()
        taken, images = [first], first.n
        for job in list(self._jobs):
            if images + job.n > self.max_batch:
                break
            if (job.size, job.preview) == (first.size, first.preview):
                self._jobs.remove(job)
                taken.append(job)
                images += job.n
        return taken

    def _decode_jobs(self, jobs: list[DecodeJob]) -> Decoded:
        done = Decoded()
        try:
            self._decode_together(jobs, done)
        except Exception as e:  # noqa: BLE001 - pinned on the job that fails, below
            if len(jobs) == 1:
                job = jobs[0]
                logger.exception("decode failed for %s", job.request_id)
                if job.preview:
                    done.previews.pop(job.request_id, None)  # a preview lost is no failure of the request
                else:
                    done.errors[job.request_id] = f"decode failed: {type(e).__name__}: {e}"
                return done
            for job in jobs:
                done.merge(self._decode_jobs([job]))
        return done

    def _decode_together(self, jobs: list[DecodeJob], done: Decoded) -> None:
        for job in jobs:
            if job.ready is not None:
                torch.cuda.current_stream().wait_event(job.ready)
        pixels = self._decode(torch.cat([job.latents for job in jobs]), jobs[0].size)
        lo = 0
        for job in jobs:
            images = self._convert(pixels[lo:lo + job.n], job.output_type)  # to the host: synchronizes
            (done.previews if job.preview else done.images)[job.request_id] = images
            if job.preview:
                done.preview_steps[job.request_id] = job.step
            lo += job.n

    def _queued_images(self) -> int:
        return sum(job.n for job in self._jobs) + sum(job.n for job in self._taken)

    def _empty_done(self) -> bool:
        return not (self._done.images or self._done.previews or self._done.errors)
