"""What a client needs to know to ask the served model for something it will run: its defaults, the sizes
and samplers it takes. /v1/models carries it (as `dvllm`, beside vLLM's fields); the playground builds its
menus from it, so it never offers a size the model refuses."""
from __future__ import annotations

from typing import Any

# Sides offered besides the default, as multiples of the default's (each rounded to the model's size step)
_SIDE_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)


def model_facts(info: Any, max_image_pixels: int, samplers: list[str]) -> dict[str, Any]:
    """info: the served ModelInfo; max_image_pixels: the engine's limit in force; samplers: those that run."""
    step = info.size_factor
    default = (info.default_width, info.default_height)
    sizes = []
    for factor in _SIDE_FACTORS:
        width, height = (max(step, round(side * factor / step) * step) for side in default)
        size = f"{width}x{height}"
        if width * height <= max_image_pixels and size not in sizes:
            sizes.append(size)
    return {
        "family": info.family,
        "default_size": f"{default[0]}x{default[1]}",
        "num_inference_steps": info.default_steps,
        "guidance_scale": info.default_guidance,
        "sampler": info.default_sampler or info.scheduler_config["_class_name"],
        "max_sequence_length": info.max_sequence_length,
        "size_multiple": step,
        "max_image_pixels": max_image_pixels,
        "sizes": sizes,
        "samplers": samplers,
    }
