"""One request's state on the worker: its latents, conditions, sampler state and RNG.

Every tensor here is this request's own; a batch is assembled from these each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SchedulerMixin

from dvllm.core.scheduler_output import NewRequestData
from dvllm.models.base import Conditions
from dvllm.samplers import SamplerPlan


@dataclass(eq=False)
class RequestState:
    data: NewRequestData
    generator: torch.Generator  # on the CPU, seeded: the same noise as diffusers on any device
    latents: torch.Tensor       # [n, C, h, w]
    cond: Conditions
    uncond: Conditions | None   # only with CFG
    fallback: SchedulerMixin | None  # a diffusers scheduler, for samplers without a vectorized update
    history: torch.Tensor | None = None  # previous x0, for multistep samplers
    step: int = 0

    @property
    def request_id(self) -> str:
        return self.data.request_id

    @property
    def plan(self) -> SamplerPlan:
        return self.data.plan

    @property
    def n(self) -> int:
        return self.data.n

    @property
    def done(self) -> bool:
        return self.step >= self.plan.num_steps
