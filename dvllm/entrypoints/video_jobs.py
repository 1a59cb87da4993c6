"""The jobs behind /v1/videos: each in OpenAI's Video shape, in a store bounded in count and in MP4 bytes.

A DELETE of an unfinished job cancels it: it stays, failed with the error code "cancelled", until a second
DELETE drops it or it is evicted as finished jobs are. A job is never lost to make room: only finished jobs
(completed or failed) are evicted, oldest first; while every slot holds an unfinished job a new one is refused (the
route answers 429). Everything here runs on the event loop (the MP4 encode runs in a thread but hands its bytes
back to the loop), so nothing needs a lock.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("queued", "in_progress", "completed", "failed")
CANCELLED = "cancelled"  # the error code of a job a DELETE ended before it finished


def new_video_id() -> str:
    """Random, so that one client cannot guess another's jobs."""
    return f"video_{secrets.token_hex(16)}"


@dataclass
class VideoJob:
    """One video request and what became of it."""

    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: float
    seed: int | None = None  # known at once when the request names it, else from the engine's first output
    id: str = field(default_factory=new_video_id)
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0  # percent
    step: int = 0  # denoising steps done, of num_steps (0 until the engine's first output)
    num_steps: int = 0
    eta_seconds: float | None = None  # the engine's estimate of its steps left (RequestOutput.eta_s)
    decode_tiled: bool = False  # its VAE decode runs in tiles (max_decode_mb; RequestOutput.decode_tiled)
    completed_at: int | None = None
    error: dict[str, Any] | None = None  # OpenAI's {code, message, param, type}
    mp4: bytes | None = None
    task: asyncio.Task | None = None  # what runs it; DELETE cancels it
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    @property
    def changed(self) -> asyncio.Event:
        """Set at the job's next change (progress, end, removal): take it before reading the job, then wait."""
        return self._changed

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def cancelled(self) -> bool:
        return self.error is not None and self.error["code"] == CANCELLED

    def advance(self, steps_done: int, num_steps: int, seed: int, eta_s: float | None = None,
                decode_tiled: bool = False) -> None:
        """A step's output: in progress, at most 99% until the MP4 is ready (decode and encode still run)."""
        if self.finished:
            return
        self.decode_tiled = decode_tiled
        percent = min(99, 100 * steps_done // max(num_steps, 1))
        status = "in_progress" if steps_done > 0 else self.status
        state = (status, percent, seed, steps_done, num_steps, eta_s)
        if state != (self.status, self.progress, self.seed, self.step, self.num_steps, self.eta_seconds):
            self.status, self.progress, self.seed, self.step, self.num_steps, self.eta_seconds = state
            self.notify()

    def cancel(self) -> None:
        """Ended by a DELETE before it finished: failed, saying so and at which step."""
        self.fail(CANCELLED, f"The video was cancelled (DELETE) after {self.step} of {self.num_steps} steps.",
                  type="cancelled")

    def fail(self, code: str, message: str, param: str | None = None, type: str = "server_error") -> None:
        if self.finished:
            return
        self.status, self.completed_at = "failed", int(time.time())
        self.error = {"code": code, "message": message, "param": param, "type": type}
        self.eta_seconds = None
        self.notify()

    def to_json(self) -> dict[str, Any]:
        """OpenAI's Video object (openai.types.Video), with dvllm's num_frames, fps, seed, step, num_steps,
        eta_seconds and decode_tiled beside its fields."""
        return {
            "id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None,
            "error": self.error, "prompt": self.prompt, "remixed_from_video_id": None,
            "size": f"{self.width}x{self.height}", "seconds": f"{self.num_frames / self.fps:g}",
            "num_frames": self.num_frames, "fps": self.fps, "seed": self.seed,
            "step": self.step, "num_steps": self.num_steps, "eta_seconds": self.eta_seconds,
            "decode_tiled": self.decode_tiled,
        }


class VideoJobs:
    """At most `capacity` jobs and `max_bytes` of MP4s; finished jobs evicted oldest first."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        if capacity < 1:
            raise ValueError(f"video_store_size must be >= 1, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"video_store_mb must be > 0, got {max_bytes / (1 << 20)}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def num_unfinished(self) -> int:
        return sum(not job.finished for job in self._jobs.values())

    def add(self, job: VideoJob) -> bool:
        """Adds the job, evicting the oldest finished one if the store is full; False (nothing added) when
        every job in it is unfinished."""
        if len(self._jobs) >= self.capacity and not self._evict_one():
            return False
        self._jobs[job.id] = job
        return True

    def get(self, job_id: str) -> VideoJob | None:
        return self._jobs.get(job_id)

    def remove(self, job_id: str) -> VideoJob | None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self.num_bytes -= len(job.mp4 or b"")
            job.notify()  # its event streams end
        return job

    def complete(self, job: VideoJob, mp4: bytes) -> None:
        """Keeps the job's MP4, evicting the oldest other finished jobs past max_bytes; an MP4 larger than
        max_bytes alone is not kept, and its job fails saying so."""
        if job.finished or self._jobs.get(job.id) is not job:
            return  # deleted meanwhile
        if len(mp4) > self.max_bytes:
            job.fail("video_too_large", f"The video's MP4 is {len(mp4)} bytes, more than this server keeps "
                                        f"({self.max_bytes} bytes, --video-store-mb); ask for fewer frames or a "
                                        "smaller size.")
            return
        self.num_bytes += len(mp4)
        while self.num_bytes > self.max_bytes and self._evict_one(keep=job.id):
            pass
        job.mp4, job.status, job.progress, job.completed_at = mp4, "completed", 100, int(time.time())
        job.step, job.eta_seconds = job.num_steps, 0.0
        job.notify()

    def page(self, after: str | None, limit: int, newest_first: bool) -> tuple[list[VideoJob], bool]:
        """Up to `limit` jobs following the one with id `after` (KeyError if it is not stored), and whether
        more follow."""
        jobs = list(self._jobs.values())
        if newest_first:
            jobs.reverse()
        start = 0
        if after is not None:
            if after not in self._jobs:
                raise KeyError(after)
            start = next(i for i, job in enumerate(jobs) if job.id == after) + 1
        return jobs[start:start + limit], len(jobs) > start + limit

    def unfinished(self) -> list[VideoJob]:
        return [job for job in self._jobs.values() if not job.finished]

    def _evict_one(self, keep: str | None = None) -> bool:
        for job_id, job in self._jobs.items():
            if job.finished and job_id != keep:
                self.remove(job_id)
                return True
        return False
