"""The denoiser run at start (EngineConfig.warm_up), so that no request pays for a compile or a capture.

With CUDA graphs, a graph is captured for every batch bucket at the model's default size, on zeros (masks
all ones, every text at its longest, as the memory profile's forward), and none is captured while serving.
Without graphs, one and two rows compile the forward (dynamo takes the second batch size as dynamic). Then
one and two rows at half the default side: dynamo takes the image's size as dynamic too (batch and size both,
a batch of one apart: dynamo specializes sizes of 1), so a request of another size runs the compiled forward
without compiling again (with graphs: compiled, without a graph).
Families whose forward shapes follow a request's input images (edits, inpainting) are not warmed up. The
sizes stay within the positions the model has (max_side). A warm-up forward that fails stops the warm-up,
logged: it is an optimization, and serving goes on (compiling as it goes, without graphs).
"""
from __future__ import annotations

import logging

import torch

from dvllm.models.base import ModelAdapter
from dvllm.models.layout import BatchLayout
from dvllm.worker.conditions import unflatten
from dvllm.worker.denoiser import Denoiser, ForwardInputs
from dvllm.worker.lora_layers import LoraLayers
from dvllm.worker.state_pool import StatePool

logger = logging.getLogger(__name__)


def warm_up(denoiser: Denoiser, adapter: ModelAdapter, pool: StatePool, lora: LoraLayers) -> list[int]:
    """The batch sizes whose forward ran (and, with graphs, holds a graph) before serving."""
    info = adapter.info
    if info.images.denoiser_takes_inputs or info.images.edit_grids is not None:
        logger.info("warm-up: none for %s: its forward's shapes follow each request's input images", adapter.name)
        return []
    graphs = denoiser.graphs is not None
    sizes = denoiser.buckets[:denoiser.max_graphs] if graphs else [r for r in denoiser.buckets if r <= 2]
    size = _within(adapter, info.default_size, 1)
    shapes = (tuple(info.latents.shape(*size)), 0)  # as input_shapes gives a text-to-image batch's
    warmed = []
    other = _within(adapter, size, 2)
    at = None
    try:
        for at in [(size, rows) for rows in sizes]:
            forward = denoiser.plan(_layout(adapter, *at), shapes, lora)
            if denoiser.warm(forward, _zeros(adapter, pool, forward.layout)) or not graphs:
                warmed.append(at[1])
        for at in [(other, r) for r in denoiser.buckets if r <= 2] if other != size else []:  # never captured
            layout = _layout(adapter, *at)
            denoiser.fn(*_zeros(adapter, pool, layout).args(), layout)
    except Exception:  # noqa: BLE001 - an optimization: serving goes on (compiling, without graphs) where it stops
        logger.warning("warm-up stopped at %s rows of %s: the rest compiles while serving, without graphs",
                       at[1], at[0], exc_info=True)
        return warmed
    logger.info("warm-up: %s for %s rows at %s; compiled for 1 and 2 at %s",
                "graphs captured" if graphs else "compiled", warmed, size, other)
    return warmed


def _within(adapter: ModelAdapter, size: tuple[int, ...], divisor: int) -> tuple[int, ...]:
    """`size`'s side divided by `divisor`, within the longest side the model has positions for (max_side), in
    multiples of the family's size factor; a video's frames kept."""
    latents = adapter.info.latents
    factor, longest = latents.size_factor, latents.max_side or max(size[:2])
    return tuple(max(factor, min(side // divisor, longest) // factor * factor) for side in size[:2]) + tuple(size[2:])


def _layout(adapter: ModelAdapter, size: tuple[int, ...], rows: int) -> BatchLayout:
    info, per_row = adapter.info, {}
    per_row["guidance"] = (info.defaults.guidance,) * rows
    if "prompt_embeds_mask" in info.text.condition_shapes:  # texts at their longest (the key of such families)
        longest = info.text.condition_shapes["prompt_embeds_mask"][0]
        per_row["text_lengths"] = ((longest, longest),) * rows
    return BatchLayout.single(size, rows, **per_row)


def _zeros(adapter: ModelAdapter, pool: StatePool, layout: BatchLayout) -> ForwardInputs:
    """A forward's inputs as model_inputs lays them out, on zeros: they become its graph's static buffers."""
    info, rows, device, dtype = adapter.info, layout.num_rows, pool.device, pool.data.dtype
    latents = torch.zeros((rows, *info.latents.shape(*layout.image_size)), dtype=dtype, device=device)
    flat = torch.zeros((rows, info.text.condition_numel), dtype=dtype, device=device)
    conditions = unflatten(flat, info.text.condition_shapes)
    for key, value in conditions.items():
        if key.endswith("_mask"):
            value.fill_(1)
    for key, value in adapter.step_conditions(layout, dtype).items():
        conditions[key] = value.to(device)
    timesteps = torch.full((rows,), 500.0, device=device)
    guidance = torch.full((rows,), float(info.defaults.guidance), device=device)
    return ForwardInputs(latents, timesteps, guidance, conditions, flat)
