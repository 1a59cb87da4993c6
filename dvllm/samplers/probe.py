"""Whether a sampler plan can really run: checked once per plan, when a request is validated.

diffusers exports schedulers that cannot step an image model at all (abstract bases, schedulers
for masked tokens or other model outputs), and some that break only at certain step counts. A
plan is built from diffusers' own `set_timesteps`, so a broken schedule fails there; a plan that
falls back to a diffusers scheduler is also stepped through its whole schedule on the smallest
latent of the model's shape, so a sampler that would fail mid-request is refused before it runs.
"""
from __future__ import annotations

import inspect

import torch

from dvllm.ops import CLIP
from dvllm.samplers.plan import SamplerPlan


def probe_plan(plan: SamplerPlan, latent_shape: tuple[int, ...]) -> None:
    """Raises (any exception) if the plan cannot run to the end on latents of `latent_shape`."""
    for row in plan.steps:  # CLIP is the x0 clamp's bound: infinite means no clamp
        values = [row.timestep, row.c_in, *(c for i, c in enumerate(row.coeffs) if i != CLIP)]
        if not all(_finite(v) for v in values):
            raise ValueError("the schedule has non-finite coefficients")
    if plan.fallback is None:
        return
    scheduler = plan.new_fallback_scheduler()
    generator = torch.Generator().manual_seed(0)
    kwargs = {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}
    sample = torch.randn((1, *latent_shape), generator=generator)
    with torch.inference_mode():
        for index in range(plan.num_steps):
            t = scheduler.timesteps[plan.start_index + index]
            if hasattr(scheduler, "scale_model_input"):
                scheduler.scale_model_input(sample, t)
            sample = scheduler.step(torch.zeros_like(sample), t, sample, **kwargs).prev_sample
            if not torch.isfinite(sample).all():
                raise ValueError(f"the sampler's step {index} gives non-finite values")


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")
