"""Step caching as a request asks for it: `SamplingParams(cache={"method": ..., **fields})`.

The methods, their fields, defaults and checks are in dvllm/step_caches/ (one module each, named in its
registry); this module parses a request's or a flag's cache into a CacheConfig with them, and sizes a row's
state for a family's transformer (step_caches/layout.py). A request's cache decisions are its own: the worker takes
them per request inside a shared forward (worker/step_cache_hooks.py). No torch here: the driver parses and
sizes with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping

from dvllm.step_caches.method import MAX_CACHE_STEP, CacheMethod, show_value
from dvllm.step_caches.registry import METHODS as _REGISTRY
from dvllm.step_caches.registry import method_of

METHODS = tuple(_REGISTRY)
_FIELDS = {name: tuple(method.fields) for name, method in _REGISTRY.items()}
_DEFAULT_ONLY = {name: method.default_only for name, method in _REGISTRY.items() if method.default_only}
__all__ = ["MAX_CACHE_STEP", "METHODS", "CacheConfig", "parse_cache", "parse_cache_flag", "show_value"]
# The request field that means "the engine's default_cache" (absent in the HTTP body); None opts out.
USE_DEFAULT = "default"


@dataclass(frozen=True, init=False, repr=False)
class CacheConfig:
    """One request's step cache: a method and its fields, defaults filled in (`config.threshold`, ...). A
    method's own helpers read as its config's too (`config.computes(step)` for taylorseer)."""

    method: str
    values: tuple[tuple[str, Any], ...] = field(default=())

    def __init__(self, method: str, **fields: Any) -> None:
        spec = method_of(method)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "values", tuple({**spec.fields, **fields}.items()))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("method", "values"):  # (unpickling asks before values is set)
            raise AttributeError(name)
        for key, value in self.values:
            if key == name:
                return value
        helper = getattr(method_of(self.method), name, None)
        if callable(helper) and name not in vars(CacheMethod):
            return partial(helper, self)
        raise AttributeError(f"{self.method} has no field {name}")

    def __repr__(self) -> str:
        return f"CacheConfig({', '.join([repr(self.method)] + [f'{k}={v!r}' for k, v in self.values])})"

    @property
    def spec(self) -> CacheMethod:
        """The method (its module's CacheMethod)."""
        return method_of(self.method)

    def replace(self, **changes: Any) -> "CacheConfig":
        return CacheConfig(self.method, **{**dict(self.values), **changes})

    def diffusers_config(self) -> Any:
        """The equivalent diffusers config (for the reference pipeline in tests and benchmarks)."""
        return self.spec.diffusers_config(self)

    def as_dict(self) -> dict[str, Any]:
        """The method and the fields it has (what the API echoes and a flag writes)."""
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in self.values}
        return {"method": self.method, **fields}


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
    name = fields.pop("method", None)
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"cache.method must be one of {list(METHODS)}, got {show_value(name)}")
    method = _REGISTRY[name]
    for key, default in method.default_only.items():
        if key in fields and fields.pop(key) != default:
            raise ValueError(f"cache.{key}: {method.default_only_why} (leave {key} at {default!r})")
    method.normalize(fields)
    unknown = sorted(set(fields) - set(method.fields))
    if unknown:
        raise ValueError(f"cache.{_field(unknown[0])} is not a field of {name} (its fields: {list(method.fields)})")
    return method.check(CacheConfig(name, **fields), set(fields))


def check_served(config: CacheConfig | None, info: Any, what: str = "cache") -> CacheConfig | None:
    """The config as the model serves it; ValueError naming `what` where the family serves no step caching,
    or not this method."""
    if config is None:
        return None
    if info.cache_layout is None:
        raise ValueError(f"{what}: {not_served_why(info)}")
    why = config.spec.unsupported(info)
    if why is not None:
        raise ValueError(why if what == "cache" else f"{what}: {why}")
    return config.spec.for_model(config, info)


def not_served_why(info: Any) -> str:
    """Why a model whose ModelInfo has no cache layout serves no step caching."""
    if info.expert_boundary is not None:
        return (f"step caching is not served with two experts (this {info.pipeline_class}, Wan 2.2 A14B): a "
                "request's kept state is the output of one transformer's blocks, which the other expert's blocks "
                "cannot reuse, and its hooks sit on one transformer (docs/video.md)")
    return (f"the {info.family} family serves no step caching (it is served for the transformer families: flux, "
            "qwen-image, stable-diffusion-3, z-image, and wan with one expert)")


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
