"""mag: diffusers' MagCacheConfig, per request.

The decision comes from the model's calibrated magnitude ratios before the forward; rows that skip run no
block at all: their hidden states become their input plus the blocks' residual kept from their last
computing step. `mag_ratios` is a list of numbers, or "flux" for diffusers' FLUX_MAG_RATIOS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dvllm.step_caches.blocks_residual import BlocksResidualRows
from dvllm.step_caches.method import (
    MAX_CACHE_STEP,
    CacheMethod,
    MethodRows,
    check_integer,
    check_threshold,
    finite,
    hidden_residuals,
    show_value,
)

MAX_MAG_RATIOS = 1000


@dataclass
class MagState:
    """MagCacheState's counters, and the calibrated ratios as diffusers interpolates them."""

    ratios: Any  # numpy float32: the same float32 arithmetic as diffusers', on the host
    step_index: int = 0
    accumulated: tuple = (1.0, 0, 0.0)  # ratio, steps, error


class Mag(CacheMethod):
    name = "mag"
    fields = {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2,  # MagCacheConfig's defaults
              "num_inference_steps": 28,  # what mag_ratios are interpolated to (MagCacheConfig's, not the request's)
              "mag_ratios": None}
    # calibration prints ratios at the end of a run: do it once with the diffusers pipeline, then serve them
    default_only = {"calibrate": False}
    default_only_why = "calibrate with the diffusers pipeline (MagCacheConfig(calibrate=True)) and pass its mag_ratios"

    def normalize(self, fields: dict[str, Any]) -> None:
        fields["mag_ratios"] = _mag_ratios(fields.get("mag_ratios"))

    def check(self, config: Any, given: set[str]) -> Any:
        config = check_threshold(config, "threshold", given)
        check_integer(config, "max_skip_steps", 0, MAX_CACHE_STEP)
        check_integer(config, "num_inference_steps", 1, MAX_MAG_RATIOS)
        r = finite(config.retention_ratio)
        if r is None or not 0 <= r <= 1:
            raise ValueError(f"cache.retention_ratio must be a number in [0, 1], "
                             f"got {show_value(config.retention_ratio)}")
        return config

    def row_numel(self, config: Any, layout: Any, tokens: Callable[[str], int]) -> int:
        return hidden_residuals(1, layout, tokens)  # the blocks' last computed residual

    def diffusers_config(self, config: Any) -> Any:
        from diffusers.hooks import MagCacheConfig

        return MagCacheConfig(threshold=config.threshold, max_skip_steps=config.max_skip_steps,
                              retention_ratio=config.retention_ratio, num_inference_steps=config.num_inference_steps,
                              mag_ratios=list(config.mag_ratios))

    def host_state(self, config: Any) -> MagState:
        return MagState(self.diffusers_config(config).mag_ratios.numpy())

    def restarted(self, config: Any, host: MagState) -> MagState:
        return host  # its counters follow the schedule's steps, which go on

    def rows(self, forward: Any, groups: list) -> MethodRows:
        return MagRows(forward, groups)


class MagRows(BlocksResidualRows):
    """diffusers' mag hooks keep the last block's hidden output minus the head block's input (slot 0)."""

    def __init__(self, forward: Any, groups: list) -> None:
        super().__init__(forward, groups)
        for g in groups:  # mag decides before the forward: its measure is the model's calibrated ratios
            g.computes, g.next = _decision(g.state)
            if g.computes:
                g.new = g.data

    def commit(self, state: Any, groups: list) -> None:
        """MagCacheBlockHook._advance_step: the next step, and a fresh start after num_inference_steps."""
        mag = state.host
        mag.accumulated, state.primed = groups[0].next, state.primed or any(g.computes for g in groups)
        mag.step_index += 1
        if mag.step_index >= state.config.num_inference_steps:
            mag.step_index, mag.accumulated, state.primed = 0, (1.0, 0, 0.0), False


def _decision(state: Any) -> tuple[bool, tuple]:
    """diffusers' MagCacheHeadHook decision (same arithmetic, float32 ratios included): whether this step
    computes, and the accumulated ratio, steps and error it leaves."""
    config, mag = state.config, state.host
    step = mag.step_index
    scale = mag.ratios[step] if step < len(mag.ratios) else 1.0
    ratio, steps, error = mag.accumulated
    if step < int(config.retention_ratio * config.num_inference_steps + 0.5):
        return True, mag.accumulated
    ratio = ratio * scale
    steps += 1
    error = error + abs(1.0 - ratio)
    if state.primed and error <= config.threshold and steps <= config.max_skip_steps:
        return False, (ratio, steps, error)
    return True, (1.0, 0, 0.0)


def _mag_ratios(value: Any) -> tuple[float, ...]:
    if isinstance(value, str) and value.lower() == "flux":
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return tuple(float(v) for v in FLUX_MAG_RATIOS)
    ratios = tuple(map(finite, value)) if isinstance(value, (list, tuple)) and len(value) <= MAX_MAG_RATIOS else ()
    if not ratios or any(r is None or r <= 0 for r in ratios):
        raise ValueError(f"cache.mag_ratios must be a list of 1 to {MAX_MAG_RATIOS} positive finite numbers (the "
                         f"model's, from a diffusers calibration run) or \"flux\", got {show_value(value)}")
    return ratios
