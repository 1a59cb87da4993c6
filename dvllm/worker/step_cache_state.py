"""What step caching keeps per request on the worker between steps (`CacheState`), what one decision
covers in a forward (`Group`), and how Taylor factors sit in the state pool. The forward itself is in
step_cache_hooks.py (TaylorSeer's attention part in taylorseer_rows.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dvllm.step_cache import CacheConfig, CacheLayout


@dataclass
class CacheState:
    """One request's step cache on the worker, between steps (its tensors are in the pool)."""

    config: CacheConfig
    text_tokens: int = 0                 # text tokens its state keeps per text (or unified) stream
    numel: int = 0                       # pool elements one of its rows takes
    primed: bool = False                 # first_block and mag: a residual is kept (step one always computes)
    last_update_step: int | None = None  # taylorseer: the last step that refreshed the factors
    num_orders: int = 0                  # taylorseer: factors valid
    # mag: MagCacheState's counters, and the calibrated ratios as diffusers interpolates them
    step_index: int = 0
    accumulated: tuple = (1.0, 0, 0.0)   # ratio, steps, error
    mag_ratios: np.ndarray | None = None  # as numpy scalars: the same float32 arithmetic, on the host
    written: bool = False                # a forward began writing its state in place and has not committed

    @classmethod
    def sized(cls, config: CacheConfig, layout: CacheLayout, data: Any) -> "CacheState":
        """For a request (NewRequestData), sized once as admission sized its blocks."""
        text_tokens, numel = layout.request_row(config, data.height, data.width, data.max_sequence_length,
                                                (data.prompt, data.negative_prompt), data.num_frames)
        return cls(config, text_tokens=text_tokens, numel=numel)

    def __post_init__(self) -> None:
        if self.config.method == "mag":
            self.mag_ratios = self.config.diffusers_config().mag_ratios.numpy()

    def restart(self) -> None:
        """Forget the kept state (a failed forward left it half written): the next step computes in full and
        keeps a new one, as the request's first step did."""
        self.primed, self.last_update_step, self.num_orders, self.written = False, None, 0, False

    def mag_decision(self) -> tuple[bool, tuple]:
        """diffusers' MagCacheHeadHook decision (same arithmetic, float32 ratios included): whether this step
        computes, and the accumulated ratio, steps and error it leaves."""
        config, step = self.config, self.step_index
        scale = self.mag_ratios[step] if step < len(self.mag_ratios) else 1.0
        ratio, steps, error = self.accumulated
        if step < int(config.retention_ratio * config.num_inference_steps + 0.5):
            return True, self.accumulated
        ratio = ratio * scale
        steps += 1
        error = error + abs(1.0 - ratio)
        if self.primed and error <= config.threshold and steps <= config.max_skip_steps:
            return False, (ratio, steps, error)
        return True, (1.0, 0, 0.0)

    def advance_mag(self, computed: bool, accumulated: tuple) -> None:
        """MagCacheBlockHook._advance_step: the next step, and a fresh start after num_inference_steps."""
        self.accumulated, self.primed = accumulated, self.primed or computed
        self.step_index += 1
        if self.step_index >= self.config.num_inference_steps:
            self.step_index, self.accumulated, self.primed = 0, (1.0, 0, 0.0), False


@dataclass(eq=False)
class Group:
    """The rows one decision covers, and their state for this forward."""

    state: CacheState
    rows: list[int]           # row indices in the forward
    index: torch.Tensor       # the same, on the device
    blocks: list[list[int]]   # each row's cache blocks in the pool
    step: int
    text_tokens: int          # text tokens its state keeps per text (or unified) stream
    data: torch.Tensor        # [rows, numel]: its state, a view of the pool (in_place) or a copy read from it
    in_place: bool = True
    computes: bool = True
    new: torch.Tensor | None = None  # what this forward writes back (computing groups)
    new_orders: int = 0              # taylorseer: factors the refresh produced
    mag_next: tuple = ()             # mag: the accumulated ratio, steps and error after this step
    local: torch.Tensor | None = None  # first_block: its rows among those that ran the head block, on the device


def factor_values(data: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """Pool elements -> factor values (see step_cache.pool_elements_per_factor): a float32 pool holds 2-byte
    factors by value (exactly: no conversion needed to compute with them), other pools hold raw bits."""
    dtype = getattr(torch, dtype_name)
    if data.dtype in (dtype, torch.float32):
        return data
    return data.view(dtype)


def pool_values(values: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    return values if values.dtype == pool_dtype else values.view(pool_dtype)


def write_state(g: Group, kept: torch.Tensor, value: torch.Tensor) -> None:
    """Part of a computing group's new state (cut or padded to the tokens it keeps), over the old."""
    g.state.written = g.state.written or g.in_place  # the pool holds part of a new state until commit
    kept.copy_(fit_tokens(value, kept.shape[1]))


def fit_tokens(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """Cut or zero-pad dimension 1 to `tokens`: text past a row's own prompt is masked out of attention,
    so what it holds never reaches the image."""
    if x.shape[1] == tokens:
        return x
    if x.shape[1] > tokens:
        return x[:, :tokens]
    return torch.nn.functional.pad(x, (0, 0, 0, tokens - x.shape[1]))


def stream_tokens(spec: Any, kind: str, image_tokens: int, text_tokens: int) -> int:
    """Tokens of one row's stream of a kind (unified: image and text, each padded to the token multiple);
    `spec` is the family's CacheSpec."""
    if kind == "unified":
        multiple = spec.layout.token_multiple
        return -(-image_tokens // multiple) * multiple + -(-text_tokens // multiple) * multiple
    return {"image": image_tokens, "text": text_tokens, "joint": text_tokens + image_tokens}[kind]
