"""Conditions <-> the flat rows the state pool stores (keys in the model's declared order)."""
from __future__ import annotations

import math

import torch

from dvllm.models.base import Conditions


def flatten(conditions: Conditions, shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """One text's Conditions ({key: [1, *shape]}) -> [1, numel]."""
    return torch.cat([conditions[key].reshape(1, -1) for key in shapes], dim=1)


def unflatten(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> Conditions:
    """[rows, numel] -> {key: [rows, *shape]} (views)."""
    out, offset = {}, 0
    for key, shape in shapes.items():
        size = math.prod(shape)
        out[key] = flat[:, offset:offset + size].view(len(flat), *shape)
        offset += size
    return out
