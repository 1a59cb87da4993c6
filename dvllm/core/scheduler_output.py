"""What crosses from the driver to the workers and back each iteration: small metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """Sent once, when a request is admitted; afterwards the worker knows it by id."""

    request_id: str
    prompt: str
    negative_prompt: str | None
    n: int
    height: int
    width: int
    seed: int
    guidance_scale: float
    cfg: bool
    output_type: str
    plan: Any  # dvllm.samplers.SamplerPlan


@dataclass
class SchedulerOutput:
    iteration: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    # One denoiser forward: these requests (one latent shape) each take their next step.
    scheduled_ids: list[str] = field(default_factory=list)
    # Requests whose state the workers must drop (aborted).
    freed_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.scheduled_ids or self.freed_ids)


@dataclass
class RunnerOutput:
    # Requests that took their last step: their final images (in the requested output type).
    images: dict[str, list[Any]] = field(default_factory=dict)
    # Requests that failed on the worker, with the message; the worker has freed them.
    errors: dict[str, str] = field(default_factory=dict)
