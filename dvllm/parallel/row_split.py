"""CFG-parallel as a split of a forward's rows: each row group of a worker group (one process, or with sequence
parallel too, a run of consecutive ranks that split the tokens) runs the denoiser call on a contiguous slice of
the batch's rows, and the leader gathers the slices' outputs in order. A batch puts every conditional row
first and the unconditional ones after (models/layout.py), so on a group of two a lone CFG request's conditional
row runs on one member and its unconditional row on the other; a larger batch is split the same way, by rows.

Which arguments are batched is read from the call (worker/row_args.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dvllm.worker.row_args import cut_rows


def call_rows(args: tuple, kwargs: dict) -> int:
    """The call's row count: its first positional argument's (UNet, Z-Image) or its `hidden_states`'."""
    first = args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))
    if first is None:
        raise ValueError("cannot tell a denoiser call's rows: no positional argument and no hidden_states")
    return len(first)


def chunk(rows: int, rank: int, world: int) -> slice:
    """Member `rank`'s contiguous rows: the first `rows % world` members take one row more."""
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def cut(args: tuple, kwargs: dict, rows: int, part: slice) -> tuple[tuple, dict]:
    """The call on the rows `part` only."""
    return (tuple(cut_rows(None, a, rows, part) for a in args),
            {k: cut_rows(k, v, rows, part) for k, v in kwargs.items()})


def _sample(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


def send_rows(output: Any) -> None:
    """A member's output rows to the leader (a list of per-row tensors, Z-Image's, goes stacked)."""
    sample = _sample(output)
    dist.send((torch.stack(list(sample)) if isinstance(sample, list) else sample).contiguous(), dst=0)


def gather_rows(output: Any, parts: list[slice], span: int = 1) -> Any:
    """The leader's output with every other row group's rows received after its own, in order: row group g's
    from its first rank, g * span (its `span` ranks split its rows' tokens and end with the same output)."""
    mine = _sample(output)
    stacked = torch.stack(mine) if isinstance(mine, list) else mine
    pieces = [stacked]
    for group, part in enumerate(parts[1:], start=1):
        if part.stop > part.start:
            piece = torch.empty((part.stop - part.start, *stacked.shape[1:]), dtype=stacked.dtype,
                                device=stacked.device)
            dist.recv(piece, src=group * span)
            pieces.append(piece)
    whole = torch.cat(pieces)
    whole = list(whole.unbind()) if isinstance(mine, list) else whole
    return (whole, *output[1:]) if isinstance(output, tuple) else whole
