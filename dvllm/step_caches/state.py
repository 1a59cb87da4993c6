"""What step caching keeps per request on the worker between steps (`CacheState`), what one decision
covers in a forward (`Group`), and how Taylor factors sit in the state pool. The forward itself is in
step_cache_hooks.py, each method's part in its module (dvllm/step_caches/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dvllm.step_caches.layout import CacheLayout


@dataclass
class CacheState:
    """One request's step cache on the worker, between steps (its tensors are in the pool)."""

    config: Any  # a step_cache.CacheConfig (made from this package's registry: not imported here)
    text_tokens: int = 0                 # text tokens its state keeps per text (or unified) stream
    numel: int = 0                       # pool elements one of its rows takes
    primed: bool = False                 # a computing step kept its state (step one always computes)
    written: bool = False                # a forward began writing its state in place and has not committed
    host: Any = None                     # what its method keeps on the host (CacheMethod.host_state)

    @classmethod
    def sized(cls, config: Any, layout: CacheLayout, data: Any) -> "CacheState":
        """For a request (NewRequestData), sized once as admission sized its blocks."""
        text_tokens, numel = layout.request_row(config, data.height, data.width, data.max_sequence_length,
                                                (data.prompt, data.negative_prompt), data.num_frames)
        return cls(config, text_tokens=text_tokens, numel=numel)

    def __post_init__(self) -> None:
        self.host = self.config.spec.host_state(self.config)

    def restart(self) -> None:
        """Forget the kept state (a failed forward left it half written): the next step computes in full and
        keeps a new one, as the request's first step did."""
        self.primed, self.written = False, False
        self.host = self.config.spec.restarted(self.config, self.host)


@dataclass(eq=False)
class Group:
    """The rows one decision covers, and their state for this forward."""

    state: CacheState
    rows: list[int]           # row indices in the forward
    index: torch.Tensor       # the same, on the device
    blocks: list[list[int]]   # each row's cache blocks in the pool
    step: int
    num_steps: int            # steps of the request's schedule
    text_tokens: int          # text tokens its state keeps per text (or unified) stream
    data: torch.Tensor        # [rows, numel]: its state, a view of the pool (in_place) or a copy read from it
    in_place: bool = True
    computes: bool = True
    new: torch.Tensor | None = None  # what this forward writes back (None: nothing)
    next: Any = None                 # what its method keeps on the host after this step (committed with it)
    local: torch.Tensor | None = None  # first_block: its rows among those that ran the head block, on the device


def factor_values(data: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """Pool elements -> factor values (see step_caches/taylorseer.pool_elements_per_factor): a float32 pool holds 2-byte
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
