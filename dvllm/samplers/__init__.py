"""Samplers: diffusers' schedules, dvllm's vectorized per-row updates."""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
from diffusers import SchedulerMixin

from dvllm.samplers.discrete import ddim_steps, lcm_steps
from dvllm.samplers.flow import flow_euler_steps
from dvllm.samplers.plan import SamplerPlan, StepRow, fallback_plan, init_noise_sigma
from dvllm.samplers.registry import SHORT_NAMES, make_scheduler
from dvllm.samplers.sigma import dpmpp_steps, euler_ancestral_steps, euler_steps
from dvllm.samplers.unipc import unipc_ok, unipc_steps

__all__ = ["SHORT_NAMES", "PlanRefused", "SamplerPlan", "StepRow", "build_plan", "history_slots", "make_scheduler"]


class PlanRefused(ValueError):
    """dvllm's own refusal of a plan, already in the user's terms (not a failure inside diffusers)."""


def _ddim_ok(c) -> bool:
    return not c.thresholding


def _dpm_ok(c) -> bool:
    return (
        c.algorithm_type == "dpmsolver++"
        and c.solver_order in (1, 2, 3)
        and c.solver_type in ("midpoint", "heun")
        and not c.thresholding
        and c.variance_type is None
        and (c.prediction_type == "flow_prediction") == bool(c.use_flow_sigmas)
        and c.prediction_type in ("epsilon", "v_prediction", "sample", "flow_prediction")
    )


class _Vectorized(NamedTuple):
    covers: Callable[[Any], bool]               # is this config one the vectorized update covers?
    steps: Callable[[Any, int], list[StepRow]]  # the per-step rows of a schedule
    history_slots: Callable[[Any], int] = lambda c: 0  # earlier x0 a row keeps
    # diffusers forms AM * model_output in the model output's dtype and keeps the latents' dtype (see SamplerPlan)
    x0_term_in_model_dtype: bool = False


# scheduler class name -> how the fused update runs it
_VECTORIZED: dict[str, _Vectorized] = {
    "DDIMScheduler": _Vectorized(_ddim_ok, ddim_steps),
    "EulerDiscreteScheduler": _Vectorized(lambda c: True, euler_steps),
    "EulerAncestralDiscreteScheduler": _Vectorized(lambda c: True, euler_ancestral_steps),
    "DPMSolverMultistepScheduler": _Vectorized(_dpm_ok, dpmpp_steps, lambda c: c.solver_order - 1,
                                               x0_term_in_model_dtype=True),
    "UniPCMultistepScheduler": _Vectorized(unipc_ok, unipc_steps, lambda c: c.solver_order,
                                           x0_term_in_model_dtype=True),
    "LCMScheduler": _Vectorized(lambda c: not c.thresholding, lcm_steps),
    "FlowMatchEulerDiscreteScheduler": _Vectorized(lambda c: True, flow_euler_steps),
}


def build_plan(model_scheduler_config: dict[str, Any], sampler: str | None, num_steps: int,
               strength: float | None = None, eta: float | None = None, step_kwargs: tuple[str, ...] = (),
               renoise: bool = False, output_dtype_differs: bool = False, **timestep_kwargs: Any) -> SamplerPlan:
    """The schedule of `sampler` for `num_steps`, as diffusers computes it; ValueError if it cannot run.
    timestep_kwargs go to set_timesteps as the model's pipeline passes them (sigmas, mu). With a
    strength (image-to-image) the run skips the schedule's first steps, as the img2img pipelines do.
    step_kwargs names what the pipeline passes to scheduler.step ("eta", "generator") when it takes them.
    renoise (inpainting with a 4-channel UNet, which takes a strength): also each step's re-noising of the
    known region. output_dtype_differs: see Schedule.output_dtype_differs."""
    scheduler = make_scheduler(model_scheduler_config, sampler)
    name = sampler or model_scheduler_config["_class_name"]
    takes = set(inspect.signature(scheduler.step).parameters) & set(step_kwargs)
    # The vectorized DDIM update is eta = 0's: another eta is stepped by diffusers itself.
    vectorize = not ("eta" in takes and eta)
    try:
        if "sigmas" in timestep_kwargs:  # a custom sigma schedule: its length is the step count
            scheduler.set_timesteps(device="cpu", **timestep_kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **timestep_kwargs)
        if strength is None:
            plan = plan_for(name, scheduler, vectorize=vectorize, model_dtype_differs=output_dtype_differs)
        else:
            plan = _img2img_plan(name, scheduler, num_steps, strength, vectorize, output_dtype_differs)
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


def history_slots(model_scheduler_config: dict[str, Any], sampler: str | None,
                  output_dtype_differs: bool = False) -> int:
    """The earlier x0 a request of this sampler keeps in the pool (0 where diffusers steps it per request)."""
    scheduler = make_scheduler(model_scheduler_config, sampler)
    entry = _vectorized(scheduler, output_dtype_differs)
    return 0 if entry is None else entry.history_slots(scheduler.config)


def _vectorized(scheduler: SchedulerMixin, model_dtype_differs: bool) -> _Vectorized | None:
    """How the fused update runs this scheduler, or None where diffusers steps it per request. With the denoiser's
    output dtype not the latents' (a bfloat16 transformer beside float32 latents), only the samplers whose
    diffusers step keeps the latents' dtype are vectorized."""
    entry = _VECTORIZED.get(type(scheduler).__name__)
    if entry is None or not entry.covers(scheduler.config):
        return None
    return None if model_dtype_differs and not entry.x0_term_in_model_dtype else entry


def plan_for(name: str, scheduler: SchedulerMixin, start: int = 0, vectorize: bool = True,
             model_dtype_differs: bool = False) -> SamplerPlan:
    entry = _vectorized(scheduler, model_dtype_differs) if vectorize else None
    if entry is None:
        return fallback_plan(name, scheduler, start)
    return SamplerPlan(name, entry.steps(scheduler, start)[start:], init_noise_sigma(scheduler),
                       history_slots=entry.history_slots(scheduler.config), start_index=start,
                       x0_term_in_model_dtype=entry.x0_term_in_model_dtype)


def _img2img_plan(name: str, scheduler: SchedulerMixin, num_steps: int, strength: float,
                  vectorize: bool = True, model_dtype_differs: bool = False) -> SamplerPlan:
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
    plan = plan_for(name, scheduler, start, vectorize, model_dtype_differs)
    plan.start_noise = (a, b)
    return plan
