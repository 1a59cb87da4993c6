"""A call's arguments cut to some of its batch's rows: what CFG-parallel gives each process of a group
(parallel/row_split.py) and what step caching runs a hooked block on (worker/hooked_call.py).

Which arguments are batched is read from the values: a tensor whose first dimension, or a list or tuple whose
length, is the batch's row count (Z-Image passes one tensor a row in a list), and a dict's values in turn.
The positions Flux and Qwen-Image pass for the whole batch are shared by every row, whatever their length."""
from __future__ import annotations

from typing import Any

import torch

# Arguments that hold one entry per token (or position), shared by every row
UNBATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb"})


def cut_rows(name: str | None, value: Any, rows: int, take: slice | list[int],
             index: torch.Tensor | None = None) -> Any:
    """Argument `name`'s `value` on the rows `take` only (a tensor's by `index`, the same rows on its device,
    when given); a value of no rows as it is."""
    if name in UNBATCHED:
        return value
    if torch.is_tensor(value):
        if not (value.dim() and value.shape[0] == rows):
            return value
        return value[take if index is None else index]
    if isinstance(value, (list, tuple)) and len(value) == rows:
        return type(value)(value[take] if isinstance(take, slice) else [value[i] for i in take])
    if isinstance(value, dict):
        return {k: cut_rows(k, v, rows, take, index) for k, v in value.items()}
    return value
