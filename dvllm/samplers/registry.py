"""Sampler names -> the diffusers scheduler they mean, built from the model's own config."""
from __future__ import annotations

from typing import Any

import diffusers
from diffusers import SchedulerMixin

# A short name means exactly `Class.from_config(model_scheduler_config, **overrides)`.
SHORT_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp_2m_karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "lcm": ("LCMScheduler", {}),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


def scheduler_class(name: str) -> type[SchedulerMixin] | None:
    if not name.endswith("Scheduler"):  # diffusers' lazy module would import whatever name it is asked for
        return None
    cls = getattr(diffusers, name, None)
    if isinstance(cls, type) and issubclass(cls, SchedulerMixin):
        return cls
    return None


def make_scheduler(model_scheduler_config: dict[str, Any], sampler: str | None) -> SchedulerMixin:
    """The diffusers scheduler a request asked for; ValueError naming the field if unknown."""
    overrides: dict[str, Any] = {}
    if sampler is None:
        class_name = model_scheduler_config["_class_name"]
    elif sampler in SHORT_NAMES:
        class_name, overrides = SHORT_NAMES[sampler]
    else:
        class_name = sampler
    cls = scheduler_class(class_name)
    if cls is None:
        raise ValueError(
            f"sampler must be one of {sorted(SHORT_NAMES)} or the class name of a diffusers scheduler, "
            f"got {sampler!r}"
        )
    return cls.from_config(model_scheduler_config, **overrides)
