"""What the engine hands back: one RequestOutput per request, progress or final."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    # Steps whose blocks (or attention) step caching skipped or predicted; None: the request had no cache.
    cached_steps: int | None = None
    # Its images came from the exact result cache (an identical seeded request served before): no step ran.
    result_cache_hit: bool = False
    # With a deadline (SamplingParams.deadline_s), once finished: whether its images were done by then
    deadline_met: bool | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    seed: int
    num_inference_steps: int
    num_steps_done: int
    finished: bool
    metrics: RequestMetrics
    images: list[Any] = field(default_factory=list)
    error: str | None = None
    # On a progress output: partial images decoded from an x0 estimate, when asked for, and the step count they
    # show: num_steps_done, or fewer when the decode stage decoded them while later steps ran.
    previews: list[Any] = field(default_factory=list)
    preview_step: int | None = None
    # Seconds until its last step is done: an estimate, its steps left times the mean of its recent step times
    # (core/step_pace.py; the decode after them is not counted). None before its first step; 0.0 once finished.
    eta_s: float | None = None
    # Its decode runs (or ran) in tiles: untiled, it was estimated above max_decode_mb (dvllm/decode_budget.py)
    decode_tiled: bool = False

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None
