"""Wan 2.2 TI2V's image-to-video: a video's first latent frame is its image's latents (models/wan_ti2v.py)."""
from __future__ import annotations

import math

import torch

from dvllm.models.base import ModelAdapter
from dvllm.worker.request_state import RequestState
from dvllm.worker.state_pool import StatePool


def hold_first_frame(adapter: ModelAdapter, pool: StatePool, states: list[RequestState],
                     errors: dict[str, str]) -> None:
    """After each step, each image request's first latent frame is its image's latents again: the pipeline
    masks them into every forward's input and into its final latents, and no other frame reads that frame."""
    info = adapter.info
    if not info.images.first_frame:
        return
    for s in states:
        if not s.input_numel or s.request_id in errors:  # text-to-video rows keep all their frames
            continue
        shape = info.latents.shape(*s.data.size)
        latents = pool.read(s.blocks.latents, math.prod(shape)).view(s.n, *shape)
        image = pool.read(s.blocks.inputs, s.input_numel).view(s.n, shape[0], 1, *shape[2:])
        pool.write(s.blocks.latents, torch.cat([image, latents[:, :, 1:]], dim=2))
