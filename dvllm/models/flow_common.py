"""What the flow-matching families share: the schedule's resolution-dependent shift."""
from __future__ import annotations

from typing import Any

import numpy as np
from diffusers.pipelines.flux.pipeline_flux import calculate_shift


def image_seq_len(height: int, width: int, vae_scale: int, patch: int) -> int:
    """Tokens the transformer sees for an image: one per patch of latents."""
    return (height // vae_scale // patch) * (width // vae_scale // patch)


def dynamic_shift_mu(config: dict[str, Any], seq_len: int) -> float:
    """The shift `mu` the pipelines compute when the scheduler uses dynamic shifting."""
    return calculate_shift(seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def linear_sigmas(num_steps: int) -> list[float]:
    """Flux's and Qwen-Image's default schedule: sigmas evenly from 1 to 1/num_steps."""
    return np.linspace(1.0, 1 / num_steps, num_steps).tolist()
