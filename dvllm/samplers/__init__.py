"""Samplers: diffusers' schedules, dvllm's vectorized per-row updates."""
from __future__ import annotations

from typing import Any, Callable

from diffusers import SchedulerMixin

from dvllm.samplers.discrete import ddim_steps, lcm_steps
from dvllm.samplers.plan import SamplerPlan, StepRow, fallback_plan, init_noise_sigma
from dvllm.samplers.registry import SHORT_NAMES, make_scheduler
from dvllm.samplers.flow import flow_euler_steps
from dvllm.samplers.sigma import dpmpp_steps, euler_ancestral_steps, euler_steps

__all__ = ["SHORT_NAMES", "SamplerPlan", "StepRow", "build_plan", "make_scheduler"]


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
               **timestep_kwargs: Any) -> SamplerPlan:
    """The schedule of `sampler` for `num_steps`, as diffusers computes it; ValueError if it cannot run.
    timestep_kwargs go to set_timesteps as the model's pipeline passes them (sigmas, mu)."""
    scheduler = make_scheduler(model_scheduler_config, sampler)
    name = sampler or model_scheduler_config["_class_name"]
    try:
        if "sigmas" in timestep_kwargs:  # a custom sigma schedule: its length is the step count
            scheduler.set_timesteps(device="cpu", **timestep_kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **timestep_kwargs)
        return plan_for(name, scheduler)
    except (ValueError, TypeError, IndexError) as e:  # e.g. a schedule that indexes past the training steps
        raise ValueError(f"num_inference_steps={num_steps} does not work with sampler {name!r}: {e}") from e


def plan_for(name: str, scheduler: SchedulerMixin) -> SamplerPlan:
    entry = _VECTORIZED.get(type(scheduler).__name__)
    if entry is None or not entry[0](scheduler.config):
        return fallback_plan(name, scheduler)
    _, steps_of, uses_history = entry
    return SamplerPlan(name, steps_of(scheduler), init_noise_sigma(scheduler), uses_history=uses_history)
