"""A request's sampler plan: diffusers' schedule, dvllm's per-step update coefficients.

The schedule (timesteps, sigmas) comes from the diffusers scheduler's own
`set_timesteps`. The update is the linear form of `dvllm.ops.sampler_update`, whose
per-step coefficients the builders in this package derive from that schedule, so a
batch of rows at different steps, with different samplers, updates in one pass.
Schedulers without a builder keep a diffusers instance and are stepped per request.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from diffusers import SchedulerMixin

from dvllm.ops import CLIP, CS, NUM_COEFFS


@dataclass(frozen=True)
class StepRow:
    """What one denoising step of one row needs: the model timestep, the input scale, the update."""

    timestep: float
    c_in: float
    coeffs: tuple[float, ...]  # NUM_COEFFS values, see dvllm.ops
    draws_noise: bool = False


@dataclass
class SamplerPlan:
    name: str
    steps: list[StepRow]
    init_noise_sigma: float
    uses_history: bool = False
    # Set only for schedulers served per request: a prototype copied for each request.
    fallback: SchedulerMixin | None = field(default=None, repr=False)
    # Image-to-image: the run begins at this index of the full schedule, from a * image_latents + b * noise.
    start_index: int = 0
    start_noise: tuple[float, float] | None = None
    # inpainting: (a, b) per step; the known region becomes a * image latents + b * first noise after it
    renoise: list[tuple[float, float]] | None = None
    # What a fallback scheduler's step() gets besides (output, t, sample), as the pipeline passes it.
    eta: float | None = None
    pass_generator: bool = False

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def vectorized(self) -> bool:
        return self.fallback is None

    def step_kwargs(self, generator: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {} if self.eta is None else {"eta": self.eta}
        if self.pass_generator:
            kwargs["generator"] = generator
        return kwargs

    def new_fallback_scheduler(self) -> SchedulerMixin:
        assert self.fallback is not None
        return copy.deepcopy(self.fallback)


def fallback_plan(name: str, scheduler: SchedulerMixin, start: int = 0) -> SamplerPlan:
    # Its rows stay out of the fused update (diffusers steps them); identity coefficients fill the step table.
    identity = tuple(1.0 if i == CS else (float("inf") if i == CLIP else 0.0) for i in range(NUM_COEFFS))
    steps = [StepRow(float(t), 1.0, identity) for t in scheduler.timesteps[start:]]
    return SamplerPlan(name, steps, init_noise_sigma(scheduler), fallback=scheduler, start_index=start)


def init_noise_sigma(scheduler: SchedulerMixin) -> float:
    # Flow-matching schedulers have none: their pipelines use the noise as drawn.
    return float(getattr(scheduler, "init_noise_sigma", 1.0))
