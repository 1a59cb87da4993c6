"""Decode as a stage of its own: finished latents (and previews' x0 estimates) go to a thread of the worker's,
which runs the VAE (on a CUDA stream of its own) and the conversion to the output type, so the denoise loop
never waits for a decode.

The loop hands over a private copy of the latents (gathered out of the pool, so their blocks are free at
once) and collects what is done at its next iteration, one result a request a collect (so each preview
arrives, in order, before the final images); a finished request's output comes a step or so later than an
in-loop decode's, with the same pixels (the same VAE calls on the same latents). A decode that
fails fails its own requests only (a batched call that raises is retried job by job). If the thread itself
dies, a new one takes over its jobs, the one it was on included: nothing that was handed over is lost.

With decode workers (decode_worker.py) the stage has a lane per worker process: each lane's thread sends its
batch to its process, whose VAE copy decodes it and converts the images. A batch whose process died is decoded
once more as it was (on the process started in its place), then job by job: a job whose process dies twice
fails its request only.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dvllm.worker.decode_worker import DecodeWorker
from dvllm.worker.stage_process import WorkerProcessLost
from dvllm.worker.stage_thread import StageThread

logger = logging.getLogger(__name__)

# (latents [n, ...] on the device, images a request, (height, width), whether each request's calls tile) -> images
# [n, 3, H, W] in [0, 1]
DecodeFn = Callable[[torch.Tensor, list[int], tuple[int, int], list[bool]], torch.Tensor]
# (images [n, 3, H, W] in [0, 1], output type) -> the request's images
ConvertFn = Callable[[torch.Tensor, str], list[Any]]


@dataclass(eq=False)
class DecodeJob:
    request_id: str
    latents: torch.Tensor  # [n, *latent shape], the job's own
    size: tuple[int, ...]  # (height, width), and a video's frames
    output_type: str
    preview: bool = False  # an x0 estimate's preview, not the final images
    step: int = 0  # the step count its latents are from
    ready: Any = None  # a CUDA event the latents' copy recorded (None on the CPU)
    lost: bool = False  # a decode worker died on it once
    tiled: bool = False  # its VAE calls run in tiles (admission chose: dvllm/decode_budget.py)

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

    def requests(self) -> set[str]:
        return {*self.images, *self.previews, *self.errors}

    def split(self) -> list[Decoded]:
        """One Decoded per request (the time and image count stay with the whole)."""
        def of(table: dict[str, Any], request_id: str) -> dict[str, Any]:
            return {request_id: table[request_id]} if request_id in table else {}

        return [Decoded(of(self.images, r), of(self.previews, r), of(self.preview_steps, r), of(self.errors, r))
                for r in sorted(self.requests())]

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
                 capacity: int, workers: list[DecodeWorker] | None = None) -> None:
        super().__init__(device, lanes=len(workers) if workers else 1)
        self._decode, self._convert = decode, convert
        self.workers = workers or []  # decode processes, one a lane; none: the lane's thread decodes
        self.max_batch, self.capacity = max_batch, capacity
        self._jobs: deque[DecodeJob] = deque()
        self._done = Decoded()
        self._later: deque[Decoded] = deque()  # a request's results behind the one _done holds for it, in order

    # -- the loop's side -----------------------------------------------------------------
    def has_room(self, images: int) -> bool:
        """Whether `images` more fit the bound on images waiting (past it the loop decodes them itself)."""
        with self._cond:
            return self._queued_images() + images <= self.capacity

    def submit(self, jobs: list[DecodeJob]) -> None:
        if self._stream is not None:
            for job in jobs:  # the copy was made on the loop's stream: the decode streams wait for it
                job.ready = torch.cuda.Event()
                job.ready.record()
                for stream in self._streams:
                    job.latents.record_stream(stream)
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
            self._bring_forward()
        return done

    @property
    def pending(self) -> int:
        """Jobs handed over and not yet collected as done."""
        return len(self._jobs) + len(self._taken) + len(self._later)

    def drop(self, request_ids: set[str]) -> None:
        """Forgets queued jobs of requests that are gone (aborted, or their worker state freed)."""
        with self._cond:
            self._jobs = deque(j for j in self._jobs if j.request_id not in request_ids)
            self._later = deque(d for d in self._later if not d.requests() & request_ids)

    def close(self, drain: bool = True) -> None:
        """Returns once the threads are done: after the jobs handed over are decoded (`drain`), or after those
        they are on (their results stay to collect); the decode processes are stopped then."""
        with self._cond:
            if not drain:
                self._jobs.clear()
        self._join()
        for worker in self.workers:
            worker.close()

    # -- the thread's side -----------------------------------------------------------------
    def _work(self, taken: list[DecodeJob], lane: int) -> Decoded:
        return self._decode_jobs(taken, lane)

    def _finish(self, taken: list[DecodeJob], result: Decoded, seconds: float) -> None:
        result.seconds, result.num_images = seconds, sum(job.n for job in taken)
        self._done.seconds += seconds
        self._done.num_images += result.num_images
        self._later.extend(result.split())
        self._bring_forward()

    def _requeue(self, taken: list[DecodeJob]) -> None:
        self._jobs.extendleft(reversed(taken))

    def _take(self) -> list[DecodeJob]:
        """The first job free to go, and those after it of the same size and kind, up to max_batch images. A
        job goes only after every earlier job of its request (none skipped over, none in flight on another
        lane, none in the same batch): a preview never comes back after its request's final images, nor
        beside its next preview. Nothing free: []."""
        held = {job.request_id for job in self._taken}
        taken: list[DecodeJob] = []
        images = 0
        for job in list(self._jobs):
            if job.request_id in held:
                continue
            if not taken or ((job.size, job.preview) == (taken[0].size, taken[0].preview)
                             and images + job.n <= self.max_batch):
                self._jobs.remove(job)
                taken.append(job)
                images += job.n
            held.add(job.request_id)  # taken or skipped, its request's later jobs wait behind this one
            if images >= self.max_batch:
                break
        return taken

    def _decode_jobs(self, jobs: list[DecodeJob], lane: int) -> Decoded:
        done = Decoded()
        try:
            self._decode_together(jobs, done, lane)
        except WorkerProcessLost as e:
            if not any(job.lost for job in jobs):  # once more as it was, on the process started in its place
                for job in jobs:
                    job.lost = True
                return self._decode_jobs(jobs, lane)
            return self._decode_apart(jobs, lane, e)
        except Exception as e:  # noqa: BLE001 - pinned on the job that fails, below
            return self._decode_apart(jobs, lane, e)
        return done

    def _decode_apart(self, jobs: list[DecodeJob], lane: int, error: Exception) -> Decoded:
        """After a batch failed: each job on its own; a job that fails alone fails its request."""
        if len(jobs) > 1:
            done = Decoded()
            for job in jobs:
                done.merge(self._decode_jobs([job], lane))
            return done
        job, done = jobs[0], Decoded()
        logger.error("decode failed for %s: %s: %s", job.request_id, type(error).__name__, error,
                     exc_info=None if isinstance(error, WorkerProcessLost) else error)
        if not job.preview:  # a preview lost is no failure of the request
            done.errors[job.request_id] = f"decode failed: {type(error).__name__}: {error}"
        return done

    def _decode_together(self, jobs: list[DecodeJob], done: Decoded, lane: int) -> None:
        for job in jobs:
            if job.ready is not None:
                torch.cuda.current_stream().wait_event(job.ready)
        latents = torch.cat([job.latents for job in jobs])
        if self.workers:  # the process decodes and converts; the latents travel on the host
            batch = (latents.cpu(), jobs[0].size, [(job.n, job.output_type, job.tiled) for job in jobs],
                     self.max_batch)
            outputs = self.workers[lane].decode(batch)
        else:
            pixels = self._decode(latents, [job.n for job in jobs], jobs[0].size, [job.tiled for job in jobs])
            outputs, lo = [], 0
            for job in jobs:
                outputs.append(self._convert(pixels[lo:lo + job.n], job.output_type))  # to the host: synchronizes
                lo += job.n
        for job, images in zip(jobs, outputs):
            (done.previews if job.preview else done.images)[job.request_id] = images
            if job.preview:
                done.preview_steps[job.request_id] = job.step

    def _queued_images(self) -> int:
        return sum(job.n for job in self._jobs) + sum(job.n for job in self._taken)

    def _bring_forward(self) -> None:
        """Finished results into what the next collect hands over, at most one a request: two previews of a
        request done between two collects both reach it (the second a collect later), and its final images
        never overtake its preview."""
        behind: deque[Decoded] = deque()
        for item in self._later:
            (request_id,) = item.requests()
            if request_id in self._done.requests() or any(request_id in b.requests() for b in behind):
                behind.append(item)
            else:
                self._done.merge(item)
        self._later = behind

    def _empty_done(self) -> bool:
        return not (self._done.images or self._done.previews or self._done.errors)
