"""One request's state on the worker: where its tensors live in the pool, its sampler and RNG."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SchedulerMixin

from dvllm.core.scheduler_output import BlockTables, NewRequestData
from dvllm.samplers import SamplerPlan
from dvllm.samplers.multistep import slot_order
from dvllm.step_caches.state import CacheState


@dataclass(eq=False)
class RequestState:
    data: NewRequestData
    generator: torch.Generator       # on the CPU, seeded: the same noise as diffusers on any device
    blocks: BlockTables | None       # None while swapped out
    fallback: SchedulerMixin | None  # a diffusers scheduler, for samplers without a vectorized update
    step: int = 0  # the step this iteration runs: set from the scheduler's output, never counted here
    host: dict[str, torch.Tensor] | None = None  # the pool contents while preempted
    cache: CacheState | None = None  # step caching: what its decisions carry between steps
    # (prompt, negative prompt) real text tokens, read once at admission where the family masks its text
    text_lengths: tuple[int, int] | None = None
    # its controls' inputs on the device, in their controlnets' dtype, made at its start (worker/start_latents.py:
    # Flux's packed latents, one per image); None in place of a control whose input is its prepared image, which
    # is read from the state pool (SD's and SDXL's: worker/control_state.py); None: it has no controls
    control_images: list[torch.Tensor | None] | None = None
    # its image prompt's (conditional, unconditional) embeds on the device (worker/ip_adapter_load.py; None: not
    # encoded yet)
    image_prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

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
    def input_numel(self) -> int:
        """Numbers per image of its input state (0: none); the adapter wrote exactly this many."""
        return self.data.input_numel

    @property
    def fallback_timestep(self) -> torch.Tensor:
        """The diffusers scheduler's own timestep for this step (an img2img run starts into its schedule)."""
        return self.fallback.timesteps[self.plan.start_index + self.step]

    def history_rows(self, num_blocks: int, slots: int) -> list[list[list[int]]]:
        """Per image, its `slots` history rows as this step's update reads them (slot_order: slot 0 the oldest,
        which the update overwrites); rows of -1 past the slots its sampler keeps."""
        kept = self.plan.history_slots if self.blocks.history is not None else 0
        absent = [[-1] * num_blocks] * (slots - kept)
        if not kept:
            return [absent for _ in range(self.n)]
        order = slot_order(self.step, kept)
        runs = self.blocks.history
        return [[runs[i * kept + k] for k in order] + absent for i in range(self.n)]


def row_bounds(states: list[RequestState]) -> list[tuple[int, int]]:
    """Each request's [lo, hi) rows in a batch laid out request by request."""
    bounds, lo = [], 0
    for s in states:
        bounds.append((lo, lo + s.n))
        lo += s.n
    return bounds
