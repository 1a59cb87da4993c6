"""taylorseer: diffusers' TaylorSeerCacheConfig, per request.

On the steps its schedule computes, a row's attention modules run and refresh their Taylor factors; on the
others their outputs are predicted from the factors, and those rows leave the attention modules' batch. The
worker part is step_caches/taylorseer_rows.py (it is the longest and needs torch throughout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from dvllm.step_caches.method import MAX_CACHE_STEP, CacheMethod, MethodRows, check_integer, show_value

FACTOR_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # name -> bytes per element
MAX_CACHE_INTERVAL = 1000
MAX_TAYLOR_ORDER = 4


@dataclass
class TaylorState:
    last_update_step: int | None = None  # the last step that refreshed the factors
    num_orders: int = 0                  # factors valid


class TaylorSeer(CacheMethod):
    name = "taylorseer"
    fields = {"cache_interval": 5, "disable_cache_before_step": 3, "disable_cache_after_step": None,
              "max_order": 1, "taylor_factors_dtype": "bfloat16"}  # TaylorSeerCacheConfig's defaults
    # TaylorSeer's module patterns are arbitrary regexes over module names; a request's state is sized first
    default_only = {"skip_predict_identifiers": None, "cache_identifiers": None, "use_lite_mode": False}
    default_only_why = "dvllm serves TaylorSeer on the default attention modules only"
    diffusers_hook_applies_directly = True

    def check(self, config: Any, given: set[str]) -> Any:
        check_integer(config, "cache_interval", 1, MAX_CACHE_INTERVAL)
        check_integer(config, "disable_cache_before_step", 0, MAX_CACHE_STEP)
        check_integer(config, "max_order", 0, MAX_TAYLOR_ORDER)
        after = config.disable_cache_after_step
        if after is not None and (isinstance(after, bool) or not isinstance(after, int)
                                  or not 0 <= after <= MAX_CACHE_STEP):
            raise ValueError(f"cache.disable_cache_after_step must be an integer in [0, {MAX_CACHE_STEP}] or null, "
                             f"got {show_value(after)}")
        dtype = config.taylor_factors_dtype
        if not isinstance(dtype, str) or dtype not in FACTOR_DTYPES:  # a list or an object is unhashable
            raise ValueError(f"cache.taylor_factors_dtype must be one of {list(FACTOR_DTYPES)}, "
                             f"got {show_value(dtype)}")
        return config

    def row_numel(self, config: Any, layout: Any, tokens: Callable[[str], int]) -> int:
        """max_order + 1 factors of every attention output."""
        values = sum(tokens(kind) for kind in layout.attention_outputs) * (config.max_order + 1) * layout.inner_dim
        return values * pool_elements_per_factor(config.taylor_factors_dtype, layout.element_bytes)

    def diffusers_config(self, config: Any) -> Any:
        import torch
        from diffusers.hooks import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(
            cache_interval=config.cache_interval, disable_cache_before_step=config.disable_cache_before_step,
            disable_cache_after_step=config.disable_cache_after_step, max_order=config.max_order,
            taylor_factors_dtype=getattr(torch, config.taylor_factors_dtype))

    def computes(self, config: Any, step: int) -> bool:
        """TaylorSeer's schedule: whether forward number `step` (from 0) runs the attention modules."""
        before, after = config.disable_cache_before_step, config.disable_cache_after_step
        return (step < before or (step - before - 1) % config.cache_interval == 0
                or (after is not None and step >= after))

    def host_state(self, config: Any) -> TaylorState:
        return TaylorState()

    def rows(self, forward: Any, groups: list) -> MethodRows:
        from dvllm.step_caches.taylorseer_rows import TaylorSeerRows

        return TaylorSeerRows(forward, groups)


def pool_elements_per_factor(dtype: str, pool_bytes: int) -> int:
    """A float32 pool holds 2-byte factors by value (exactly); a 2-byte pool holds float32 factors as two
    elements of raw bits, and factors of the other 2-byte type as one."""
    return math.ceil(FACTOR_DTYPES[dtype] / pool_bytes)
