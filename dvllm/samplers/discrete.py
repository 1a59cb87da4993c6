"""Coefficients for the schedulers that step on alphas_cumprod: DDIM (eta=0) and LCM."""
from __future__ import annotations

import math

import torch

from dvllm.samplers.plan import StepRow

INF = float("inf")


def x0_coeffs(prediction_type: str, alpha: float) -> tuple[float, float]:
    """(ax, am) so that x0 = ax * sample + am * model_output at alphas_cumprod `alpha`."""
    beta = 1.0 - alpha
    if prediction_type == "epsilon":
        return 1.0 / math.sqrt(alpha), -math.sqrt(beta) / math.sqrt(alpha)
    if prediction_type == "v_prediction":
        return math.sqrt(alpha), -math.sqrt(beta)
    if prediction_type == "sample":
        return 0.0, 1.0
    raise ValueError(f"prediction_type {prediction_type!r} is not supported")


def clip_value(config) -> float:
    return float(config.clip_sample_range) if config.clip_sample else INF


def _alpha(scheduler, timestep: int) -> float:
    if timestep >= 0:
        return float(scheduler.alphas_cumprod[timestep])
    return float(scheduler.final_alpha_cumprod)


def ddim_steps(scheduler, start: int = 0) -> list[StepRow]:
    config = scheduler.config
    ratio = config.num_train_timesteps // scheduler.num_inference_steps
    clip = clip_value(config)
    rows = []
    for t in scheduler.timesteps.tolist():
        alpha, alpha_prev = _alpha(scheduler, t), _alpha(scheduler, t - ratio)
        ax, am = x0_coeffs(config.prediction_type, alpha)
        # diffusers: prev = sqrt(alpha_prev) * x0 + sqrt(1 - alpha_prev) * eps, where x0 may be
        # clipped but eps is derived from the unclipped model output.
        direction = math.sqrt(1.0 - alpha_prev)
        if config.prediction_type == "epsilon":
            cs, cm = 0.0, direction
        elif config.prediction_type == "v_prediction":
            cs, cm = direction * math.sqrt(1.0 - alpha), direction * math.sqrt(alpha)
        else:  # "sample"
            cs, cm = direction / math.sqrt(1.0 - alpha), -direction * math.sqrt(alpha) / math.sqrt(1.0 - alpha)
        rows.append(StepRow(float(t), 1.0, (ax, am, clip, cs, cm, math.sqrt(alpha_prev), 0.0, 0.0)))
    return rows


def lcm_steps(scheduler, start: int = 0) -> list[StepRow]:
    config = scheduler.config
    timesteps = scheduler.timesteps
    clip = clip_value(config)
    rows = []
    for i, t in enumerate(timesteps.tolist()):
        prev_t = timesteps[i + 1].item() if i + 1 < len(timesteps) else t
        alpha, alpha_prev = _alpha(scheduler, t), _alpha(scheduler, prev_t)
        ax, am = x0_coeffs(config.prediction_type, alpha)
        c_skip, c_out = (float(c) for c in scheduler.get_scalings_for_boundary_condition_discrete(torch.tensor(t)))
        # denoised = c_out * x0 + c_skip * sample; all but the last step re-noise it to prev_t.
        if i != scheduler.num_inference_steps - 1:
            keep = math.sqrt(alpha_prev)
            coeffs = (ax, am, clip, keep * c_skip, 0.0, keep * c_out, 0.0, math.sqrt(1.0 - alpha_prev))
            rows.append(StepRow(float(t), 1.0, coeffs, draws_noise=True))
        else:
            rows.append(StepRow(float(t), 1.0, (ax, am, clip, c_skip, 0.0, c_out, 0.0, 0.0)))
    return rows
