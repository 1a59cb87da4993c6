"""Requests' prepared control images as state-pool entries (core/request_blocks.py gives each distinct image one
entry, shared by every control that sends it): written once by the first request that holds the entry, read by
each step's control plan, kept across preemption like a prompt's conditions."""
from __future__ import annotations

import torch

from dvllm.core.scheduler_output import NewRequestData
from dvllm.worker.request_state import RequestState
from dvllm.worker.state_pool import StatePool


def write_control_images(pool: StatePool, new: list[NewRequestData]) -> None:
    """Fills the entries these newly admitted requests are the first to hold. Every new request's, live or not:
    another one admitted now or later may read the entry, and a pool copy cannot fail as an encode can."""
    for d in new:
        for blocks, write, control in zip(d.blocks.controls, d.blocks.write_controls, d.controls):
            if write:
                pool.write([list(blocks)], control.image.to(device=pool.device, dtype=pool.data.dtype))


def read_control_images(pool: StatePool, rows: list[tuple[int, ...]], shape: tuple[int, ...],
                        dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), *shape] images in `dtype` (the controlnet's; the pool keeps them in the denoiser's, which is
    the same in every family that takes controlnets, so no number is rounded twice), one gather."""
    numel = shape[0] * shape[1] * shape[2]
    return pool.read([list(r) for r in rows], numel).view(len(rows), *shape).to(dtype)


def control_image_shape(state: RequestState) -> tuple[int, int, int]:
    return (3, state.data.height, state.data.width)
