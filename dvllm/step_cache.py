"""Step caching as a request asks for it: `SamplingParams(cache={"method": ..., **fields})`.

The methods and their fields are diffusers' cache configs, with diffusers' defaults:
`first_block` is `FirstBlockCacheConfig`, `taylorseer` is `TaylorSeerCacheConfig`. A request's cache
decisions are its own: the worker takes them per request inside a shared forward
(worker/step_cache_hooks.py). This module has no torch: the driver parses and sizes with it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

METHODS = ("first_block", "taylorseer")
FACTOR_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # name -> bytes per element
MAX_CACHE_INTERVAL = 1000
MAX_TAYLOR_ORDER = 4
# The request field that means "the engine's default_cache" (absent in the HTTP body); None opts out.
USE_DEFAULT = "default"


@dataclass(frozen=True)
class CacheConfig:
    """One request's step cache. Fields as diffusers' FirstBlockCacheConfig / TaylorSeerCacheConfig."""

    method: str
    threshold: float = 0.05  # first_block
    cache_interval: int = 5  # taylorseer from here on
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: str = "bfloat16"

    def diffusers_config(self) -> Any:
        """The equivalent diffusers config (for the reference pipeline in tests and benchmarks)."""
        import torch
        from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

        if self.method == "first_block":
            return FirstBlockCacheConfig(threshold=self.threshold)
        return TaylorSeerCacheConfig(
            cache_interval=self.cache_interval, disable_cache_before_step=self.disable_cache_before_step,
            disable_cache_after_step=self.disable_cache_after_step, max_order=self.max_order,
            taylor_factors_dtype=getattr(torch, self.taylor_factors_dtype))

    def computes(self, step: int) -> bool:
        """TaylorSeer's schedule: whether forward number `step` (from 0) runs the attention modules."""
        before, after = self.disable_cache_before_step, self.disable_cache_after_step
        return (step < before or (step - before - 1) % self.cache_interval == 0
                or (after is not None and step >= after))

    def as_dict(self) -> dict[str, Any]:
        """The method and the fields it has (what the API echoes and a flag writes)."""
        names = _FIELDS[self.method]
        return {"method": self.method, **{k: getattr(self, k) for k in names}}


_FIELDS = {
    "first_block": ("threshold",),
    "taylorseer": ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order",
                   "taylor_factors_dtype"),
}
# TaylorSeerCacheConfig fields dvllm takes only at their defaults: their module patterns are arbitrary
# regexes over the model's module names, and a request's state must be sized before it runs.
_DEFAULT_ONLY = {"skip_predict_identifiers": None, "cache_identifiers": None, "use_lite_mode": False}


def parse_cache(value: Any) -> CacheConfig | None:
    """A request's `cache` (a dict, a CacheConfig or None) -> CacheConfig or None; ValueError naming the field."""
    if value is None or isinstance(value, CacheConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"cache must be an object like {{\"method\": \"first_block\", \"threshold\": 0.05}} or null, "
                         f"got {type(value).__name__}")
    fields = dict(value)
    method = fields.pop("method", None)
    if method not in METHODS:
        raise ValueError(f"cache.method must be one of {list(METHODS)}, got {method!r}")
    for name, default in _DEFAULT_ONLY.items():
        if method == "taylorseer" and name in fields:
            if fields.pop(name) != default:
                raise ValueError(f"cache.{name}: dvllm serves TaylorSeer on the default attention modules only "
                                 f"(leave {name} at {default!r})")
    unknown = sorted(set(fields) - set(_FIELDS[method]))
    if unknown:
        raise ValueError(f"cache.{unknown[0]} is not a field of {method} (its fields: {list(_FIELDS[method])})")
    config = CacheConfig(method=method, **fields)
    _check(config, set(fields))
    return config


def _check(config: CacheConfig, given: set[str]) -> None:
    if "threshold" in given:
        t = config.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ValueError(f"cache.threshold must be a finite number >= 0, got {t!r}")
        object.__setattr__(config, "threshold", float(t))
    for name, low, high in (("cache_interval", 1, MAX_CACHE_INTERVAL), ("disable_cache_before_step", 0, None),
                            ("max_order", 0, MAX_TAYLOR_ORDER)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bound = f"in [{low}, {high}]" if high else f">= {low}"
            raise ValueError(f"cache.{name} must be an integer {bound}, got {value!r}")
    after = config.disable_cache_after_step
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
        raise ValueError(f"cache.disable_cache_after_step must be an integer >= 0 or null, got {after!r}")
    if config.taylor_factors_dtype not in FACTOR_DTYPES:
        raise ValueError(f"cache.taylor_factors_dtype must be one of {list(FACTOR_DTYPES)}, "
                         f"got {config.taylor_factors_dtype!r}")


def parse_cache_flag(text: str) -> CacheConfig | None:
    """`first_block:threshold=0.08`, `taylorseer:cache_interval=4,max_order=2`, `none` (CLI flags)."""
    if text.strip().lower() in ("none", "null", "off"):
        return None
    method, _, rest = text.partition(":")
    fields: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        name, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"cache: expected name=value, got {item!r} (e.g. first_block:threshold=0.08)")
        try:
            fields[name.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            fields[name.strip()] = raw.strip()  # a bare word: a dtype name
    return parse_cache(fields)


@dataclass(frozen=True)
class CacheLayout:
    """A family's transformer, as much as the driver needs to size one row's cache state.

    Tokens: `image` (one per latent patch), `text` (the prompt's: `text_tokens_for`), `joint` (text then image, as one sequence), `unified` (image then text,
    each padded to a multiple of `token_multiple`: Z-Image's single stream). `hidden_kind` is the blocks'
    hidden stream (what first_block keeps); `attention_outputs` lists the token kind of every output of
    every attention module TaylorSeer predicts, in order.
    """

    inner_dim: int
    pixels_per_token: int  # along each side: the VAE's scale times the transformer's patch
    attention_outputs: tuple[str, ...]
    text_tokens: int | None = None
    element_bytes: int = 4  # of the state pool (the model's dtype)
    hidden_kind: str = "image"
    token_multiple: int = 1
    # Byte-level BPE text (Qwen-Image): a text has at most one token per UTF-8 byte, plus this many of the
    # pipeline's template (its bytes less the tokens it drops); the state keeps no more text tokens than
    # that (the worker checks it).
    text_bytes_extra: int | None = None

    def text_tokens_for(self, max_sequence_length: int | None, texts: tuple[str | None, ...]) -> int:
        """Text tokens a request's state keeps per text output: the family's fixed length, or its
        max_sequence_length, bounded by its longest text where the tokenizer allows."""
        if self.text_tokens:
            return self.text_tokens
        tokens = max_sequence_length or 0
        if self.text_bytes_extra is not None:
            longest = max(len((t or "").encode("utf-8")) for t in texts)
            tokens = min(tokens, longest + self.text_bytes_extra)
        return tokens

    def image_tokens(self, height: int, width: int) -> int:
        return (height // self.pixels_per_token) * (width // self.pixels_per_token)

    def tokens(self, kind: str, height: int, width: int, text: int) -> int:
        image = self.image_tokens(height, width)
        if kind == "unified":
            return _round_up(image, self.token_multiple) + _round_up(text, self.token_multiple)
        return {"image": image, "text": text, "joint": text + image}[kind]

    def row_numel(self, config: CacheConfig, height: int, width: int, text_tokens: int) -> int:
        """Pool elements one model row's cache state takes (text_tokens: `text_tokens_for` the request).

        first_block keeps two image-stream tensors per row: the head block's last computed residual and
        the tail's residual. TaylorSeer keeps max_order + 1 factors of every attention output.
        """
        if config.method == "first_block":
            return 2 * self.tokens(self.hidden_kind, height, width, text_tokens) * self.inner_dim
        values = sum(self.tokens(kind, height, width, text_tokens) for kind in self.attention_outputs)
        values *= (config.max_order + 1) * self.inner_dim
        return values * pool_elements_per_factor(config.taylor_factors_dtype, self.element_bytes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pool_elements_per_factor(dtype: str, pool_bytes: int) -> int:
    """A float32 pool holds 2-byte factors by value (exactly); a 2-byte pool holds float32 factors as two
    elements of raw bits, and factors of the other 2-byte type as one."""
    return math.ceil(FACTOR_DTYPES[dtype] / pool_bytes)
