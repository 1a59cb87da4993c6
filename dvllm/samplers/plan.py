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

from dvllm.ops import AM, AX, CLIP, CM, CN, CS, CX, NUM_COEFFS
from dvllm.sampler_coeffs import HISTORY_COEFFS


@dataclass(frozen=True)
class StepRow:
    """What one denoising step of one row needs: the model timestep, the input scale, the update."""

    timestep: float
    c_in: float
    # NUM_COEFFS values in dvllm/sampler_coeffs.py's order; a shorter tuple (AX..CN: samplers that keep at most
    # one earlier x0) leaves the other history slots' weights at zero.
    coeffs: tuple[float, ...]
    draws_noise: bool = False

    def __post_init__(self) -> None:
        if len(self.coeffs) > NUM_COEFFS:
            raise ValueError(f"a step has {NUM_COEFFS} update coefficients, got {len(self.coeffs)}")
        object.__setattr__(self, "coeffs", tuple(self.coeffs) + (0.0,) * (NUM_COEFFS - len(self.coeffs)))


def update_coeffs(ax: float, am: float, cs: float, cx: float, history: tuple[float, ...] = (), cm: float = 0.0,
                  clip: float = float("inf"), cn: float = 0.0) -> tuple[float, ...]:
    """A step's coefficients by name; `history` weighs the history slots in order (CH, CH1, CH2)."""
    values = {AX: ax, AM: am, CLIP: clip, CS: cs, CM: cm, CX: cx, CN: cn}
    values.update(zip(HISTORY_COEFFS, history))
    return tuple(values.get(i, 0.0) for i in range(NUM_COEFFS))


@dataclass
class SamplerPlan:
    name: str
    steps: list[StepRow]
    init_noise_sigma: float
    history_slots: int = 0  # earlier x0 a row keeps in the pool (multistep samplers), at most MAX_HISTORY
    # diffusers forms the model output's x0 term, AM * model_output, in the model output's dtype (a bfloat16
    # transformer beside float32 latents): dvllm rounds it the same way (dvllm/worker/model_dtype_product.py)
    x0_term_in_model_dtype: bool = False
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
    def uses_history(self) -> bool:
        return self.history_slots > 0

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
