"""A forward's ControlNet plan: its groups of rows, each running one controlnet call, in the order their outputs
are added (worker/controlnets.py's ControlPlanner makes it each step; the families' hooks and the memory profile
read it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from dvllm.worker.control_calls import ControlCall


@dataclass
class ControlGroup:
    """Rows of one forward that run one controlnet at one scale, for the same place in their lists."""

    controlnet: Any
    index: torch.Tensor     # the rows, on the device
    inputs: torch.Tensor    # [rows, ...] their control inputs (SD: the prepared image; Flux: its packed latents)
    scale: float
    kind: Hashable          # what the family's hook needs of the rows' requests (one per group)
    guidance: torch.Tensor  # [rows] float32, their requests' guidance scales (for controlnets that embed it)
    call: ControlCall | None = None      # what the rows share (an SDXL union call's modes and scales)
    more: tuple[torch.Tensor, ...] = ()  # an SDXL union call's later controls' inputs, in order
    row_modes: torch.Tensor | None = None  # [rows] long: a union Flux controlnet's mode per row
    rows: tuple[int, ...] = ()  # the rows, on the host (for a denoiser that takes a list of rows: Z-Image's)


@dataclass
class ControlPlan:
    groups: list[ControlGroup]  # in the order their outputs are added
