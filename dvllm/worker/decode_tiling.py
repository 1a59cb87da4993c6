"""The measure a request's tiled decode is chosen from (dvllm/decode_budget.py): one untiled decode's peak per
pixel, taken once at the worker's start."""
from __future__ import annotations

import logging
import math

import torch

from dvllm.decode_budget import DecodeBudget
from dvllm.models.base import ModelAdapter
from dvllm.worker.memory_profile import DeviceMemory, largest_size
from dvllm.worker.peak_tracker import PeakTracker
from dvllm.worker.vae_calls import can_tile

logger = logging.getLogger(__name__)
# The measured decode's area (pixels a frame, at most): large enough that the VAE's fixed costs do not swamp the
# per-pixel ones, small enough to cost nothing at start
REFERENCE_PIXELS = 256 * 256


def reference_size(adapter: ModelAdapter) -> tuple[int, ...]:
    """The measured decode's size: a square of at most REFERENCE_PIXELS, and a video's shortest clip past one
    frame."""
    info = adapter.info
    return largest_size(info, REFERENCE_PIXELS, None if info.video is None else 1 + info.video.frame_multiple)


def measure_budget(adapter: ModelAdapter, limit_bytes: int | None) -> DecodeBudget:
    """The decode budget of this worker: `limit_bytes` (max_decode_mb; None: nothing tiles, nothing measured) and
    the peak per pixel of one untiled decode of one image at reference_size, on the device (a GPU's allocator),
    or counted by the storages ops make (the CPU)."""
    vae = adapter.pipeline.vae
    if limit_bytes is None:
        return DecodeBudget(can_tile=can_tile(vae))
    size = reference_size(adapter)
    latents = torch.zeros((1, *adapter.info.latents.shape(*size)), dtype=adapter.state_dtype, device=adapter.device)

    def decode() -> None:
        with adapter.vae_lock:
            adapter.decode(latents, size)

    with torch.inference_mode():
        if adapter.device.type == "cuda":
            peak = DeviceMemory(adapter.device).measure(decode)
        else:
            with PeakTracker() as tracker:
                decode()
            peak = tracker.peak
    budget = DecodeBudget(limit_bytes, peak / math.prod(size), can_tile(vae))
    logger.info("decode budget: %.1f MiB a call (max_decode_mb); an untiled decode takes ~%.0f bytes a pixel "
                "(measured at %s)%s", limit_bytes / 2**20, budget.bytes_per_pixel, "x".join(map(str, size)),
                "" if budget.can_tile else f"; {type(vae).__name__} cannot tile: every decode runs untiled")
    return budget
