"""The protocol every step-cache method follows, and the checks its fields share.

A method is one class: its driver part (name, fields with defaults, their checks, the families that serve it,
the state a request's row keeps in the pool) runs without torch; its worker part (`rows`: decide which rows
skip at a step, run the hooked modules for computing and skipping rows, commit the per-row state after the
forward) runs inside the batched forward that worker/step_cache_hooks.py drives. The worker parts import torch
and the worker's helpers inside their methods, so that the driver imports every method module without torch.
"""
from __future__ import annotations

import math
import reprlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    from dvllm.step_caches.layout import CacheLayout

# A request's step_cache.CacheConfig and a family's ModelInfo, as the methods take them: named, not imported (a
# CacheConfig is made from this package's registry, and a ModelInfo lists the methods its family serves).
CacheConfig = Any
ModelInfo = Any

# Step numbers and step counts: far past any schedule served (max_inference_steps is 1000 by default), where
# every larger value means the same; it keeps them small integers for the worker and torch.
MAX_CACHE_STEP = 100_000
MAX_SHOWN_CHARS = 120  # of a value quoted in an error message


class CacheMethod:
    """One step-cache method. Subclasses set the class attributes and override what their method does."""

    name: ClassVar[str]
    fields: ClassVar[dict[str, Any]]  # field -> default, in the order the API echoes them
    # Fields dvllm takes only at these values (a request may send them so), and why
    default_only: ClassVar[dict[str, Any]] = {}
    default_only_why: ClassVar[str] = ""
    in_diffusers: ClassVar[bool] = True  # diffusers has it (diffusers_config), the reference pipelines' baseline
    # diffusers' hook for it runs on a transformer without enable_cache (SD3), applied inside a cache context
    diffusers_hook_applies_directly: ClassVar[bool] = False

    # -- driver (no torch) ------------------------------------------------------------------------------------
    def normalize(self, fields: dict[str, Any]) -> None:
        """Rewrite a request's raw fields in place before they are checked (e.g. a preset's name -> values)."""

    def check(self, config: "CacheConfig", given: set[str]) -> "CacheConfig":
        """The config with its values checked (and coerced); ValueError naming the field. `given`: the fields
        the request sent (the others are defaults)."""
        return config

    def unsupported(self, info: "ModelInfo") -> str | None:
        """Why a family (one that serves step caching) cannot serve this method; None when it can."""
        return None

    def for_model(self, config: "CacheConfig", info: "ModelInfo") -> "CacheConfig":
        """The config as the model serves it (model facts a request left out filled in)."""
        return config

    def row_numel(self, config: "CacheConfig", layout: "CacheLayout", tokens: Callable[[str], int]) -> int:
        """Pool elements one model row's state takes; `tokens(kind)`: a row's tokens of a stream kind."""
        raise NotImplementedError

    def diffusers_config(self, config: "CacheConfig") -> Any:
        """The equivalent diffusers config (for the reference pipeline in tests and benchmarks)."""
        raise ValueError(f"cache.method: diffusers has no {self.name} cache to compare with")

    # -- worker (torch) ---------------------------------------------------------------------------------------
    def host_state(self, config: "CacheConfig") -> Any:
        """What a request keeps on the host between steps beyond CacheState's own fields (None: nothing);
        made afresh when its state restarts."""
        return None

    def restarted(self, config: "CacheConfig", host: Any) -> Any:
        """The host state after a failed forward left the pool's half written (the next step computes)."""
        return self.host_state(config)

    def rows(self, forward: Any, groups: list) -> "MethodRows":
        """This method's part of one forward (worker/step_cache_hooks.ForwardCache), over its groups."""
        raise NotImplementedError


class MethodRows:
    """A method's groups in one forward. The forward calls these in order: `before_head` (the first block's
    call, every row), `after_head` (its output, on the rows that ran it), `attention` (each attention
    module's call, handles_attention methods), `keep` (at the last block, the computing rows' output), `fill`
    (the skipping rows' hidden states), then `commit` once the forward and the sampler's update succeeded.
    Decisions taken before the forward go in __init__."""

    # Rows that skip run no block at all (not even the first): their hidden states are their input plus the
    # residual kept from their last computing step. False: they run some modules (first_block's head).
    skips_head: ClassVar[bool] = False
    handles_attention: ClassVar[bool] = False  # the attention modules' calls are this method's (taylorseer)

    def __init__(self, forward: Any, groups: list) -> None:
        self.forward, self.groups = forward, groups

    def before_head(self, call: Any) -> None:
        """Decide from the first block's input (skips_head methods)."""

    def after_head(self, arguments: dict, hidden_in: Any, rows: list[int]) -> set[int]:
        """Decide from the first block's output; returns the rows that skip the blocks after it."""
        return set()

    def keep(self, hidden: Any, position: dict[int, int]) -> None:
        """At the last block: what computing groups keep of its hidden output (`position`: row -> index)."""

    def attention(self, module: int, call: Any, rows: list[int]) -> Any:
        """Attention module number `module` called on the forward rows `rows` (handles_attention methods)."""
        return call.run()

    def fill(self, hidden: Any) -> None:
        """Write the skipping groups' hidden states into `hidden` (the batch, every row)."""

    def commit(self, state: Any, groups: list) -> None:
        """A request's host state after a successful forward (`groups`: its groups in it)."""


def show_value(value: Any) -> str:
    """A client's value as an error message quotes it: at most MAX_SHOWN_CHARS, and encodable as UTF-8 (repr
    escapes a lone surrogate, which would make the JSON error response itself fail)."""
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = shown.maxlong = 60
    try:
        return shown.repr(value)[:MAX_SHOWN_CHARS]
    except (ValueError, RecursionError):  # an integer past Python's digit limit, a value nested too deep
        return f"a {type(value).__name__}"


def finite(value: Any) -> float | None:
    """A number as a finite float; None for anything else (a bool, text, NaN, an integer past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_integer(config: "CacheConfig", name: str, low: int, high: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"cache.{name} must be an integer in [{low}, {high}], got {show_value(value)}")


def check_threshold(config: "CacheConfig", name: str, given: set[str]) -> "CacheConfig":
    """A threshold the request sent: a finite number >= 0, kept as a float."""
    if name not in given:
        return config
    value = finite(getattr(config, name))
    if value is None or value < 0:
        raise ValueError(f"cache.{name} must be a finite number >= 0, got {show_value(getattr(config, name))}")
    return config.replace(**{name: value})


def hidden_residuals(count: int, layout: "CacheLayout", tokens: Callable[[str], int]) -> int:
    """Pool elements of `count` tensors of the blocks' hidden stream."""
    return count * tokens(layout.hidden_kind) * layout.inner_dim
