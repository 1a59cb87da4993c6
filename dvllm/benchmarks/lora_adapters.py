"""Random LoRA adapters for a pipeline, for benchmarks: diffusers-format folders, as a trainer saves them.

The state dict is built straight from the denoiser's Linear shapes (no copy of the model, so this works at
real sizes) in peft's key format, and written with the pipeline class's own `save_lora_weights`, so that
`load_lora_weights` and dvllm read it as they would a user's adapter.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from dvllm.models.base import denoiser_component

# The attention projections: self-attention everywhere, and the text stream of the DiT families.
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def make_adapter(pipe: Any, folder: str, seed: int, rank: int = 16, targets: tuple[str, ...] = ATTENTION_TARGETS,
                 std: float = 0.5) -> str:
    """Saves a rank-`rank` adapter on every denoiser Linear whose name ends with one of `targets`; returns the
    folder. A ~ N(0, 1/in) and B ~ N(0, (std / r)^2) at alpha = r: the update B @ A x is a few percent of a
    unit-scale activation, non-trivial yet far from overflowing in half precision."""
    from peft import LoraConfig

    component = denoiser_component(pipe)
    model = getattr(pipe, component)
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    layers: dict[str, torch.Tensor] = {}
    present: set[str] = set()
    for name, module in model.named_modules():
        target = next((t for t in targets if name == t or name.endswith("." + t)), None)
        if target is None or not isinstance(module, torch.nn.Linear):
            continue
        present.add(target)
        a = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
        b = torch.randn(module.out_features, rank, generator=generator) * (std / rank)
        layers[f"{name}.lora_A.weight"] = a.to(dtype)
        layers[f"{name}.lora_B.weight"] = b.to(dtype)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Linear layer named like {targets}")
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(present))
    os.makedirs(folder, exist_ok=True)
    type(pipe).save_lora_weights(folder, **{f"{component}_lora_layers": layers,
                                            f"{component}_lora_adapter_metadata": config.to_dict()})
    return folder


def make_adapters(pipe: Any, root: str, count: int, rank: int = 16) -> dict[str, str]:
    """`count` distinct adapters (seeds 0..count-1) under `root`: name -> folder."""
    return {f"lora{i}": make_adapter(pipe, os.path.join(root, f"lora{i}"), seed=i, rank=rank) for i in range(count)}
