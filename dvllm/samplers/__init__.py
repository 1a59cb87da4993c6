"""Samplers: diffusers' schedules, dvllm's vectorized per-row updates."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from diffusers import SchedulerMixin

from dvllm.samplers.discrete import ddim_steps, lcm_steps
from dvllm.samplers.flow import flow_euler_steps
from dvllm.samplers.plan import SamplerPlan, StepRow, fallback_plan, init_noise_sigma
from dvllm.samplers.registry import SHORT_NAMES, make_scheduler
from dvllm.samplers.sigma import dpmpp_steps, euler_ancestral_steps, euler_steps

__all__ = ["SHORT_NAMES", "PlanRefused", "SamplerPlan", "StepRow", "build_plan", "make_scheduler"]


class PlanRefused(ValueError):
    """dvllm's own refusal of a plan, already in the user's terms (not a failure inside diffusers)."""


def _ddim_ok(c) -> bool:
    return not c.thresholding


def _dpm_ok(c) -> bool:
    return (
        c.algorithm_type == "dpmsolver++"
        and c.solver_order in (1, 2)
        and c.solver_type in ("midpoint", "heun")
        and not c.thresholding
        and c.variance_type is None
        and not c.use_flow_sigmas
        and c.prediction_type in ("epsilon", "v_prediction", "sample")
    )


# class name -> (is this config one the vectorized update covers?, per-step rows, keeps x0 history?)
_VECTORIZED: dict[str, tuple[Callable[[Any], bool], Callable[[Any], list[StepRow]], bool]] = {
    "DDIMScheduler": (_ddim_ok, ddim_steps, False),
    "EulerDiscreteScheduler": (lambda c: True, euler_steps, False),
    "EulerAncestralDiscreteScheduler": (lambda c: True, euler_ancestral_steps, False),
    "DPMSolverMultistepScheduler": (_dpm_ok, dpmpp_steps, True),
    "LCMScheduler": (lambda c: not c.thresholding, lcm_steps, False),
    "FlowMatchEulerDiscreteScheduler": (lambda c: True, flow_euler_steps, False),
}


def build_plan(model_scheduler_config: dict[str, Any], sampler: str | None, num_steps: int,
               strength: float | None = None, eta: float | None = None, step_kwargs: tuple[str, ...] = (),
               renoise: bool = False, fused: bool = True, **timestep_kwargs: Any) -> SamplerPlan:
    """The schedule of `sampler` for `num_steps`, as diffusers computes it; ValueError if it cannot run.
    timestep_kwargs go to set_timesteps as the model's pipeline passes them (sigmas, mu). With a
    strength (image-to-image) the run skips the schedule's first steps, as the img2img pipelines do.
    step_kwargs names what the pipeline passes to scheduler.step ("eta", "generator") when it takes them.
    renoise (inpainting with a 4-channel UNet, which takes a strength): also each step's re-noising of the
    known region. fused=False: every sampler is stepped by diffusers (Schedule.fused_update)."""
    scheduler = make_scheduler(model_scheduler_config, sampler)
    name = sampler or model_scheduler_config["_class_name"]
    takes = set(inspect.signature(scheduler.step).parameters) & set(step_kwargs)
    # The vectorized DDIM update is eta = 0's: another eta is stepped by diffusers itself.
    vectorize = fused and not ("eta" in takes and eta)
    try:
        if "sigmas" in timestep_kwargs:  # a custom sigma schedule: its length is the step count
            scheduler.set_timesteps(device="cpu", **timestep_kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **timestep_kwargs)
        if strength is None:
            plan = plan_for(name, scheduler, vectorize=vectorize)
        else:
            plan = _img2img_plan(name, scheduler, num_steps, strength, vectorize)
            if renoise:
                plan.renoise = _renoise_coeffs(scheduler, plan.start_index, len(plan.steps))
        plan.eta = eta if "eta" in takes else None
        plan.pass_generator = "generator" in takes
        return plan
    except PlanRefused:
        raise
    except (ValueError, TypeError, IndexError) as e:  # e.g. a schedule that indexes past the training steps
        raise ValueError(f"num_inference_steps={num_steps} does not work with sampler {name!r}: {e}") from e


def _renoise_coeffs(scheduler: SchedulerMixin, start: int, num_steps: int) -> list[tuple[float, float]]:
    """After step k the inpainting pipelines put the known region back as scheduler.add_noise(image latents,
    first noise, timesteps[k + 1]), and as the clean image latents after the last step. add_noise is linear:
    its two coefficients per step, read with the scheduler where the pipeline's would be then (its step index
    one past k: schedulers that keep one look the sigma up by it, the others by the timestep)."""
    one, zero = torch.ones(1), torch.zeros(1)
    coeffs = []
    for k in range(num_steps - 1):
        index = start + k + 1
        if hasattr(scheduler, "_step_index"):
            scheduler._step_index = index
        t = scheduler.timesteps[index:index + 1]
        coeffs.append((float(scheduler.add_noise(one, zero, t)), float(scheduler.add_noise(zero, one, t))))
    if hasattr(scheduler, "_step_index"):
        scheduler._step_index = None
    return coeffs + [(1.0, 0.0)]


def plan_for(name: str, scheduler: SchedulerMixin, start: int = 0, vectorize: bool = True) -> SamplerPlan:
    entry = _VECTORIZED.get(type(scheduler).__name__)
    if not vectorize or entry is None or not entry[0](scheduler.config):
        return fallback_plan(name, scheduler, start)
    _, steps_of, uses_history = entry
    return SamplerPlan(name, steps_of(scheduler, start)[start:], init_noise_sigma(scheduler), uses_history=uses_history,
                       start_index=start)


def _img2img_plan(name: str, scheduler: SchedulerMixin, num_steps: int, strength: float,
                  vectorize: bool = True) -> SamplerPlan:
    # As the img2img pipelines' get_timesteps: skip the first (1 - strength) of the schedule.
    start = (num_steps - min(int(num_steps * strength), num_steps)) * scheduler.order
    if start >= len(scheduler.timesteps):
        raise PlanRefused(f"strength={strength} leaves no step to run out of {num_steps}; raise strength or steps")
    if not hasattr(scheduler, "add_noise"):
        raise PlanRefused(f"sampler {name!r} cannot start from an image (its scheduler has no add_noise)")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    # add_noise is linear in (image latents, noise): read its two coefficients at the start timestep.
    t = scheduler.timesteps[start:start + 1]
    one, zero = torch.ones(1), torch.zeros(1)
    a, b = float(scheduler.add_noise(one, zero, t)), float(scheduler.add_noise(zero, one, t))
    plan = plan_for(name, scheduler, start, vectorize)
    plan.start_noise = (a, b)
    return plan
