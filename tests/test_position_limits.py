"""A size past the denoiser's position tables is refused at admission: Z-Image's RoPE tables cover a fixed
number of tokens per side, and on a GPU an index past them is a device-side assert that ends the process (the
GPU run of 2026-12-04 met it in the memory profile's worst step). The memory profile's worst size stays inside."""
from __future__ import annotations

import pytest
import torch

from dvllm.config import EngineConfig
from dvllm.models.loader import load_adapter
from dvllm.sampling_params import SamplingParams
from dvllm.worker.memory_profile import largest_size


def test_z_image_sizes_stop_at_its_rope_tables(z_image_path):
    info = load_adapter(z_image_path, "auto", torch.device("cpu"), torch.float32).info
    # the tiny model's tables: 32 positions a side, a token per 2x2 latents of a 2x VAE: 128 pixels
    assert info.latents.max_side == 128
    config = EngineConfig(model=z_image_path, device="cpu", max_image_pixels=1024 * 1024)
    assert SamplingParams(height=128, width=64).resolve(info, config).height == 128
    with pytest.raises(ValueError, match="at most 128 for this model"):
        SamplingParams(height=64, width=136).resolve(info, config)
    assert largest_size(info, config.pixel_limit(info)) == (128, 128)
