"""What the multistep solvers (DPM-Solver++, UniPC) share: their noise levels and their x0 prediction.

Both step in log-SNR (lambda) between the schedule's sigmas and keep their last few x0 predictions as
history slots of the fused update; `by_slot` lays a step's weights of those earlier x0 out as the update
reads them (dvllm/sampler_coeffs.py: slot 0 holds the oldest and is overwritten with this step's x0).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from dvllm.sampler_coeffs import MAX_HISTORY


def alpha_sigma(config: Any, sigma: float) -> tuple[float, float]:
    """(alpha_t, sigma_t) at the schedule's sigma: flow sigmas interpolate, the others are Karras sigmas."""
    if config.use_flow_sigmas:
        return 1.0 - sigma, sigma
    alpha = 1.0 / math.sqrt(sigma**2 + 1.0)
    return alpha, sigma * alpha


def log_snr(config: Any, sigma: float) -> float:
    """lambda = log(alpha_t) - log(sigma_t); +inf at sigma 0 (the schedule's clean end)."""
    alpha, sigma_t = alpha_sigma(config, sigma)
    return math.inf if sigma_t == 0.0 else math.log(alpha) - math.log(sigma_t)


def x0_coeffs(prediction_type: str, config: Any, sigma: float) -> tuple[float, float]:
    """(ax, am) so that the solver's x0 prediction is ax * sample + am * model_output at this sigma."""
    alpha, sigma_t = alpha_sigma(config, sigma)
    if prediction_type == "epsilon":
        return 1.0 / alpha, -sigma_t / alpha
    if prediction_type == "v_prediction":
        return alpha, -sigma_t
    if prediction_type == "sample":
        return 0.0, 1.0
    if prediction_type == "flow_prediction":
        return 1.0, -sigma
    raise ValueError(f"prediction_type {prediction_type!r} is not supported")


def by_slot(by_age: Sequence[float], slots: int) -> tuple[float, ...]:
    """Weights of the earlier x0 given by age (by_age[0]: the last step's) as the update's history columns
    (CH, CH1, CH2): with `slots` kept, slot 0 holds age `slots`, slot k age `slots - k`. Padded to MAX_HISTORY."""
    if len(by_age) > slots:
        raise ValueError(f"{len(by_age)} earlier x0 weighed, {slots} kept")
    ages = list(by_age) + [0.0] * (slots - len(by_age))
    return tuple(ages[slots - 1 - k] for k in range(slots)) + (0.0,) * (MAX_HISTORY - slots)


def slot_order(step: int, slots: int) -> list[int]:
    """Which of a row's `slots` stored history runs the update reads as slot 0, 1, ... at the row's `step`
    (counted from its first): the x0 of step s is written to run s % slots, so slot 0 (the oldest, about to be
    overwritten) is run step % slots, and the runs rotate instead of being copied."""
    return [(step + k) % slots for k in range(slots)]
