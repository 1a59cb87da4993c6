"""Step caching as a request asks for it: `SamplingParams(cache={"method": ..., **fields})`.

The methods and their fields are diffusers' cache configs, with diffusers' defaults:
`first_block` is `FirstBlockCacheConfig`, `taylorseer` is `TaylorSeerCacheConfig`, `mag` is
`MagCacheConfig` (its `mag_ratios` a list of numbers, or "flux" for diffusers' FLUX_MAG_RATIOS). A request's cache
decisions are its own: the worker takes them per request inside a shared forward
(worker/step_cache_hooks.py). This module has no torch: the driver parses and sizes with it.
"""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping

METHODS = ("first_block", "taylorseer", "mag")
DEFAULT_THRESHOLDS = {"first_block": 0.05, "mag": 0.06}  # FirstBlockCacheConfig's and MagCacheConfig's
MAX_MAG_RATIOS = 1000
FACTOR_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # name -> bytes per element
MAX_CACHE_INTERVAL = 1000
MAX_TAYLOR_ORDER = 4
# Step numbers and step counts: far past any schedule served (max_inference_steps is 1000 by default), where
# every larger value means the same; it keeps them small integers for the worker and torch.
MAX_CACHE_STEP = 100_000
MAX_SHOWN_CHARS = 120  # of a value quoted in an error message
# The request field that means "the engine's default_cache" (absent in the HTTP body); None opts out.
USE_DEFAULT = "default"


@dataclass(frozen=True)
class CacheConfig:
    """One request's step cache. Fields as diffusers' FirstBlockCacheConfig / TaylorSeerCacheConfig /
    MagCacheConfig."""

    method: str
    threshold: float | None = None  # first_block and mag (None: the method's default)
    cache_interval: int = 5  # taylorseer from here on
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: str = "bfloat16"
    max_skip_steps: int = 3  # mag from here on
    retention_ratio: float = 0.2
    num_inference_steps: int = 28  # what mag_ratios are interpolated to (MagCacheConfig's, not the request's)
    mag_ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.threshold is None and self.method in DEFAULT_THRESHOLDS:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLDS[self.method])

    def diffusers_config(self) -> Any:
        """The equivalent diffusers config (for the reference pipeline in tests and benchmarks)."""
        import torch
        from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

        if self.method == "first_block":
            return FirstBlockCacheConfig(threshold=self.threshold)
        if self.method == "mag":
            return MagCacheConfig(threshold=self.threshold, max_skip_steps=self.max_skip_steps,
                                  retention_ratio=self.retention_ratio, num_inference_steps=self.num_inference_steps,
                                  mag_ratios=list(self.mag_ratios))
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
        fields = {k: getattr(self, k) for k in names}
        if self.mag_ratios is not None:
            fields["mag_ratios"] = list(self.mag_ratios)
        return {"method": self.method, **fields}


_FIELDS = {
    "first_block": ("threshold",),
    "taylorseer": ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order",
                   "taylor_factors_dtype"),
    "mag": ("threshold", "max_skip_steps", "retention_ratio", "num_inference_steps", "mag_ratios"),
}
# Fields dvllm takes only at their defaults, and why.
_DEFAULT_ONLY = {
    # TaylorSeer's module patterns are arbitrary regexes over module names; a request's state is sized first
    "taylorseer": {"skip_predict_identifiers": None, "cache_identifiers": None, "use_lite_mode": False},
    # calibration prints ratios at the end of a run: do it once with the diffusers pipeline, then serve them
    "mag": {"calibrate": False},
}


def parse_cache(value: Any) -> CacheConfig | None:
    """A request's `cache` (a dict, a CacheConfig or None) -> CacheConfig or None; ValueError naming the field."""
    if value is None or isinstance(value, CacheConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"cache must be an object like {{\"method\": \"first_block\", \"threshold\": 0.05}} or null, "
                         f"got {type(value).__name__}")
    fields = dict(value)
    not_names = [name for name in fields if not isinstance(name, str)]
    if not_names:
        raise ValueError(f"cache: field names must be strings, got {show_value(not_names[0])}")
    method = fields.pop("method", None)
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"cache.method must be one of {list(METHODS)}, got {show_value(method)}")
    for name, default in _DEFAULT_ONLY.get(method, {}).items():
        if name in fields and fields.pop(name) != default:
            why = ("dvllm serves TaylorSeer on the default attention modules only" if method == "taylorseer" else
                   "calibrate with the diffusers pipeline (MagCacheConfig(calibrate=True)) and pass its mag_ratios")
            raise ValueError(f"cache.{name}: {why} (leave {name} at {default!r})")
    if method == "mag":
        fields["mag_ratios"] = _mag_ratios(fields.get("mag_ratios"))
    unknown = sorted(set(fields) - set(_FIELDS[method]))
    if unknown:
        raise ValueError(f"cache.{_field(unknown[0])} is not a field of {method} (its fields: {list(_FIELDS[method])})")
    config = CacheConfig(method=method, **fields)
    _check(config, set(fields))
    return config


def _mag_ratios(value: Any) -> tuple[float, ...]:
    if isinstance(value, str) and value.lower() == "flux":
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return tuple(float(v) for v in FLUX_MAG_RATIOS)
    ratios = tuple(map(_finite, value)) if isinstance(value, (list, tuple)) and len(value) <= MAX_MAG_RATIOS else ()
    if not ratios or any(r is None or r <= 0 for r in ratios):
        raise ValueError(f"cache.mag_ratios must be a list of 1 to {MAX_MAG_RATIOS} positive finite numbers (the "
                         f"model's, from a diffusers calibration run) or \"flux\", got {show_value(value)}")
    return ratios


def _check(config: CacheConfig, given: set[str]) -> None:
    if "threshold" in given:
        t = _finite(config.threshold)
        if t is None or t < 0:
            raise ValueError(f"cache.threshold must be a finite number >= 0, got {show_value(config.threshold)}")
        object.__setattr__(config, "threshold", t)
    for name, low, high in (("cache_interval", 1, MAX_CACHE_INTERVAL), ("disable_cache_before_step", 0, MAX_CACHE_STEP),
                            ("max_order", 0, MAX_TAYLOR_ORDER), ("max_skip_steps", 0, MAX_CACHE_STEP),
                            ("num_inference_steps", 1, MAX_MAG_RATIOS)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"cache.{name} must be an integer in [{low}, {high}], got {show_value(value)}")
    after = config.disable_cache_after_step
    if after is not None and (isinstance(after, bool) or not isinstance(after, int)
                              or not 0 <= after <= MAX_CACHE_STEP):
        raise ValueError(f"cache.disable_cache_after_step must be an integer in [0, {MAX_CACHE_STEP}] or null, "
                         f"got {show_value(after)}")
    r = _finite(config.retention_ratio)
    if r is None or not 0 <= r <= 1:
        raise ValueError(f"cache.retention_ratio must be a number in [0, 1], "
                         f"got {show_value(config.retention_ratio)}")
    dtype = config.taylor_factors_dtype
    if not isinstance(dtype, str) or dtype not in FACTOR_DTYPES:  # a list or an object is unhashable
        raise ValueError(f"cache.taylor_factors_dtype must be one of {list(FACTOR_DTYPES)}, "
                         f"got {show_value(dtype)}")


def _finite(value: Any) -> float | None:
    """A number as a finite float; None for anything else (a bool, text, NaN, an integer past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def show_value(value: Any) -> str:
    """A client's value as an error message quotes it: at most MAX_SHOWN_CHARS, and encodable as UTF-8 (repr
    escapes a lone surrogate, which would make the JSON error response itself fail)."""
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = shown.maxlong = 60
    try:
        return shown.repr(value)[:MAX_SHOWN_CHARS]
    except (ValueError, RecursionError):  # an integer past Python's digit limit, a value nested too deep
        return f"a {type(value).__name__}"


def _field(name: str) -> str:
    """A field name as cache.<name> quotes it: as sent when it is a plain identifier, else shown as a value."""
    return name if name.isidentifier() and name.isascii() and len(name) <= 64 else show_value(name)


def _split_fields(text: str) -> list[str]:
    """Split on commas outside brackets: `threshold=0.1,mag_ratios=[1.0,1.2]`."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def parse_cache_flag(text: str) -> CacheConfig | None:
    """`first_block:threshold=0.08`, `taylorseer:cache_interval=4,max_order=2`, `none` (CLI flags)."""
    if text.strip().lower() in ("none", "null", "off"):
        return None
    method, _, rest = text.partition(":")
    fields: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (part.strip() for part in _split_fields(rest))):
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

    Tokens: `image` (one per latent patch), `text` (the prompt's: `text_tokens_for`), `joint` (text then
    image, as one sequence), `unified` (image then text,
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
    # Video (Wan): image tokens are per latent frame, the VAE keeping the first frame and packing each
    # temporal_scale after it into one. 0: images.
    temporal_scale: int = 0

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

    def image_tokens(self, height: int, width: int, frames: int | None = None) -> int:
        plane = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return plane * ((max(frames or 1, 1) - 1) // self.temporal_scale + 1 if self.temporal_scale else 1)

    def tokens(self, kind: str, height: int, width: int, text: int, frames: int | None = None) -> int:
        image = self.image_tokens(height, width, frames)
        if kind == "unified":
            return _round_up(image, self.token_multiple) + _round_up(text, self.token_multiple)
        return {"image": image, "text": text, "joint": text + image}[kind]

    def request_row(self, config: CacheConfig, height: int, width: int, max_sequence_length: int | None,
                    texts: tuple[str | None, ...], frames: int | None = None) -> tuple[int, int]:
        """A request's text tokens kept per text stream, and the pool elements one of its rows takes."""
        text_tokens = self.text_tokens_for(max_sequence_length, texts)
        return text_tokens, self.row_numel(config, height, width, text_tokens, frames)

    def row_numel(self, config: CacheConfig, height: int, width: int, text_tokens: int,
                  frames: int | None = None) -> int:
        """Pool elements one model row's cache state takes (text_tokens: `text_tokens_for` the request).

        first_block keeps two hidden-stream tensors per row: the head block's last computed residual and
        the tail's residual; mag keeps one, the blocks' last computed residual. TaylorSeer keeps
        max_order + 1 factors of every attention output.
        """
        if config.method in ("first_block", "mag"):
            residuals = 2 if config.method == "first_block" else 1
            return residuals * self.tokens(self.hidden_kind, height, width, text_tokens, frames) * self.inner_dim
        values = sum(self.tokens(kind, height, width, text_tokens, frames) for kind in self.attention_outputs)
        values *= (config.max_order + 1) * self.inner_dim
        return values * pool_elements_per_factor(config.taylor_factors_dtype, self.element_bytes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pool_elements_per_factor(dtype: str, pool_bytes: int) -> int:
    """A float32 pool holds 2-byte factors by value (exactly); a 2-byte pool holds float32 factors as two
    elements of raw bits, and factors of the other 2-byte type as one."""
    return math.ceil(FACTOR_DTYPES[dtype] / pool_bytes)
