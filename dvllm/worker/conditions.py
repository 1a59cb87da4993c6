"""Conditions <-> the flat rows the state pool stores (keys in the model's declared order), and texts encoded
straight to those rows (the encode stage's call, and an encode worker's)."""
from __future__ import annotations

import math
from typing import Any

import torch

from dvllm.models.base import Conditions, ModelAdapter
from dvllm.request_sizes import as_images


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


def encode_flat(adapter: ModelAdapter, texts: list[tuple[str | None, bool]], max_sequence_length: int | None,
                images: Any = None) -> torch.Tensor:
    """Texts of one length (read with one request's images, for an edit model whose encoder reads them) -> their
    conditions flattened, [texts, numel], on the adapter's device (the encode stage's call, and an encode
    worker's)."""
    kwargs = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if images is not None:
        kwargs["images"] = as_images(images)
    conditions = adapter.on_device(adapter.encode_prompt(texts, **kwargs))
    shapes = adapter.info.text.condition_shapes
    return torch.cat([flatten(c, shapes) for c in conditions])
