"""Every step-cache method, by the name a request gives (`SamplingParams(cache={"method": name, ...})`).
Adding a method: its module (a CacheMethod subclass) and one line here."""
from __future__ import annotations

from dvllm.step_caches.first_block import FirstBlock
from dvllm.step_caches.mag import Mag
from dvllm.step_caches.method import CacheMethod
from dvllm.step_caches.taylorseer import TaylorSeer
from dvllm.step_caches.teacache import TeaCache

METHODS: dict[str, CacheMethod] = {method.name: method for method in (
    FirstBlock(),
    TaylorSeer(),
    Mag(),
    TeaCache(),
)}


def method_of(name: str) -> CacheMethod:
    """The method a config names (a config's method was checked when it was parsed)."""
    return METHODS[name]


def served_methods(info: object) -> tuple[str, ...]:
    """The methods a family serves (each method asks the family's ModelInfo): none where it serves no step caching."""
    if getattr(info, "cache_layout", None) is None:
        return ()
    return tuple(name for name, method in METHODS.items() if method.unsupported(info) is None)
