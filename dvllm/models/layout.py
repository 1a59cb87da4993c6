"""Who each row of one denoiser forward is: the batch layout, known on the host before the forward runs.

A forward's rows are laid out request by request, the requests with CFG first, then those requests' rows
again for the unconditional branch, in the same order: the unconditional half is one contiguous block,
and row `num_cond + i` is row i's unconditional copy. Everything that treats rows apart (the adapter's per-row texts and input images,
LoRA layers, step caching, guidance) reads this one layout instead of re-deriving it, and reads host
values from it: nothing on the per-step path has to read a tensor back from the device to learn them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

RowAdapters = tuple[tuple[str, float], ...]  # one row's LoRA adapters: (adapter digest, weight)
Grids = tuple[int, ...]  # an edit row's input images' token grids, flat: (rows, columns) per image


@dataclass(frozen=True)
class BatchLayout:
    image_size: tuple[int, ...]  # (height, width), and a video's frames after them: one size per forward
    counts: tuple[int, ...] = (1,)                     # images per request, in row order
    num_cfg_requests: int = 0                          # the first ones also run unconditionally
    guidance: tuple[float, ...] = ()                   # per request: its guidance scale
    text_lengths: tuple[tuple[int, int], ...] | None = None  # per request: (prompt, negative) real text tokens
    image_grids: tuple[Grids, ...] = ()                # per request (edits only)
    loras: tuple[RowAdapters, ...] = ()                # per request (empty: no request has adapters)
    aesthetic_scores: tuple[tuple[float, float], ...] = ()  # per request: (prompt's, negative's) (SDXL refiner)
    pad: int = 0                                       # rows appended as copies of the last (bucketing)
    experts: tuple[int, ...] = ()                      # per request: its step's expert (two-expert models)
    first_frames: tuple[bool, ...] = ()                # per request: its first latent frame is given (TI2V)

    # derived in __post_init__ (plain attributes, not cached properties: torch.compile traces reads of them)
    num_cond: int = field(init=False)
    num_cfg: int = field(init=False)                   # rows of the unconditional block: the CFG requests' images
    num_rows: int = field(init=False)
    bounds: tuple[tuple[int, int], ...] = field(init=False)   # each request's [lo, hi) conditional rows
    row_request: tuple[int, ...] = field(init=False)   # forward row -> its request's index (padding: the last's)
    row_negative: tuple[bool, ...] = field(init=False)  # forward row -> whether it runs the unconditional branch
    row_text_lengths: tuple[int, ...] | None = field(init=False)  # each row's real text tokens (None: no mask)
    row_grids: tuple[Grids, ...] = field(init=False)
    row_loras: tuple[RowAdapters, ...] = field(init=False)   # empty: no row has adapters
    row_experts: tuple[int, ...] = field(init=False)  # empty: one expert

    def __post_init__(self) -> None:
        derived: dict[str, Any] = {"num_cond": sum(self.counts), "num_cfg": sum(self.counts[:self.num_cfg_requests])}
        derived["num_rows"] = derived["num_cond"] + derived["num_cfg"] + self.pad
        bounds, lo = [], 0
        for n in self.counts:
            bounds.append((lo, lo + n))
            lo += n
        cond = [i for i, n in enumerate(self.counts) for _ in range(n)]
        requests = cond + cond[:derived["num_cfg"]]
        negative = [False] * len(cond) + [True] * derived["num_cfg"]
        requests, negative = requests + requests[-1:] * self.pad, negative + negative[-1:] * self.pad
        derived.update(bounds=tuple(bounds), row_request=tuple(requests), row_negative=tuple(negative))
        derived["row_text_lengths"] = None if self.text_lengths is None else tuple(
            self.text_lengths[r][neg] for r, neg in zip(requests, negative))
        derived["row_grids"] = tuple(self.image_grids[r] for r in requests) if self.image_grids else ()
        derived["row_loras"] = tuple(self.loras[r] for r in requests) if any(self.loras) else ()
        derived["row_experts"] = tuple(self.experts[r] for r in requests) if self.experts else ()
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def single(cls, image_size: tuple[int, ...], rows: int, **per_row: Any) -> "BatchLayout":
        """`rows` independent conditional rows (one image each): for callers outside step batching."""
        return cls(image_size=image_size, counts=(1,) * rows, **per_row)

    def request_rows(self, request: int) -> tuple[list[int], list[int]]:
        """A request's conditional rows and its unconditional ones (empty without CFG)."""
        lo, hi = self.bounds[request]
        cond = list(range(lo, hi))
        return cond, [self.num_cond + r for r in cond] if request < self.num_cfg_requests else []

    def per_row(self, values: Sequence[Any]) -> list[Any]:
        """One value per request -> one per forward row."""
        return [values[r] for r in self.row_request]

    def lay_out(self, target: torch.Tensor | None, values: torch.Tensor | None = None) -> torch.Tensor:
        """Per conditional row `values` ([num_cond, ...]; None: already in target's first rows) written into
        target's forward rows ([num_rows, ...]; None: a new tensor): the conditional rows, the CFG requests'
        again for their other branch, then the padding, copies of the last row. Returns target."""
        n, m = self.num_cond, self.num_cond + self.num_cfg
        if target is None:
            target = values.new_empty((self.num_rows, *values.shape[1:]))
        if values is not None:
            target[:n].copy_(values)
        if m > n:
            target[n:m].copy_(target[:m - n])
        if self.pad:
            target[m:].copy_(target[m - 1:m].expand(self.pad, *target.shape[1:]))
        return target

    def padded(self, rows: int) -> "BatchLayout":
        """This layout with rows appended, each a copy of the last, up to `rows` in all."""
        extra = rows - self.num_rows
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_rows} rows to {rows}")
        return self if extra == 0 else dataclasses.replace(self, pad=self.pad + extra)

