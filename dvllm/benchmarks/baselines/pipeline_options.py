"""A request's LoRA set and step cache on the diffusers pipeline, as its users run them: adapters loaded once with
`load_lora_weights` and chosen per call with `set_adapters` (LoRA off for a request with none), and diffusers' own
cache on the transformer for the span of a call (`enable_cache`, or its hooks where the model has none)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dvllm.step_cache import CacheConfig


def use_loras(pipeline: Any, loaded: list[str], loras: dict[str, float] | None) -> None:
    """The request's adapters active at their weights, or none of the loaded ones."""
    if not loaded:
        if loras:
            raise ValueError(f"loras {sorted(loras)}: the pipeline was loaded with no adapters")
        return
    if loras:
        pipeline.enable_lora()
        pipeline.set_adapters(list(loras), adapter_weights=list(loras.values()))
    else:
        pipeline.disable_lora()


def diffusers_cache_unsupported(transformer: torch.nn.Module, config: CacheConfig) -> str | None:
    """Why diffusers cannot run this cache on this transformer; None when it can."""
    if not config.spec.in_diffusers:
        return f"diffusers has no {config.method} cache (dvllm's is tested against its own reference)"
    if hasattr(transformer, "enable_cache"):
        return None
    if type(transformer).__name__ == "SD3Transformer2DModel" and config.spec.diffusers_hook_applies_directly:
        return None
    return (f"diffusers' {config.method} cache does not run on {type(transformer).__name__} (it has no "
            f"enable_cache, and this benchmark knows no direct use of diffusers' hooks that runs on it)")


@contextlib.contextmanager
def diffusers_cache(transformer: torch.nn.Module, config: CacheConfig | None) -> Iterator[None]:
    """diffusers' own cache on the transformer for the span (none: nothing): enable_cache where it has one,
    otherwise (SD3 TaylorSeer) diffusers' hook applied directly inside a cache context, removed after."""
    if config is None:
        yield
        return
    if hasattr(transformer, "enable_cache"):
        transformer.enable_cache(config.diffusers_config())
        try:
            yield
        finally:
            transformer.disable_cache()
        return
    from diffusers.hooks import HookRegistry, apply_taylorseer_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    apply_taylorseer_cache(transformer, config.diffusers_config())
    _set_cache_context(transformer, CacheContext("cond"))  # one call per step: CFG rows share it
    try:
        yield
    finally:
        _set_cache_context(transformer, None)
        HookRegistry.check_if_exists_or_initialize(transformer).remove_hook(_TAYLORSEER_CACHE_HOOK, recurse=True)
