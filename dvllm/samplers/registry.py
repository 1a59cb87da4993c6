"""Sampler names -> the diffusers scheduler they mean, built from the model's own config."""
from __future__ import annotations

from typing import Any

from diffusers import SchedulerMixin

from dvllm.logging_setup import quiet_libraries
from dvllm.sampler_names import SHORT_NAMES, scheduler_class

__all__ = ["SHORT_NAMES", "make_scheduler", "scheduler_class"]


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
    with quiet_libraries():  # diffusers' notes on config keys another class ignores, not the request's business
        return cls.from_config(model_scheduler_config, **overrides)
