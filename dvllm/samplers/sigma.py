"""Coefficients for the schedulers that step on sigmas: Euler, Euler ancestral, DPM-Solver++."""
from __future__ import annotations

import math

import torch

from dvllm.samplers.plan import StepRow

INF = float("inf")


def _x0_coeffs_karras(prediction_type: str, sigma: float) -> tuple[float, float]:
    """(ax, am) for the Euler schedulers' x0 prediction at noise level sigma."""
    if prediction_type == "epsilon":
        return 1.0, -sigma
    if prediction_type == "v_prediction":
        return 1.0 / (sigma**2 + 1.0), -sigma / math.sqrt(sigma**2 + 1.0)
    if prediction_type in ("sample", "original_sample"):
        return 0.0, 1.0
    raise ValueError(f"prediction_type {prediction_type!r} is not supported")


def _c_in(sigma: float) -> float:
    return 1.0 / math.sqrt(sigma**2 + 1.0)


def euler_steps(scheduler, start: int = 0) -> list[StepRow]:
    sigmas = scheduler.sigmas.tolist()
    prediction = scheduler.config.prediction_type
    rows = []
    for i, t in enumerate(scheduler.timesteps.tolist()):
        sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
        ax, am = _x0_coeffs_karras(prediction, sigma)
        # prev = sample + (sample - x0) / sigma * dt   (s_churn = 0, as the pipeline calls it)
        rows.append(StepRow(float(t), _c_in(sigma), (ax, am, INF, 1.0 + dt / sigma, 0.0, -dt / sigma, 0.0, 0.0)))
    return rows


def euler_ancestral_steps(scheduler, start: int = 0) -> list[StepRow]:
    sigmas = scheduler.sigmas.tolist()
    prediction = scheduler.config.prediction_type
    if prediction not in ("epsilon", "v_prediction"):
        raise ValueError(f"euler_a supports prediction_type 'epsilon' or 'v_prediction', not {prediction!r}")
    rows = []
    for i, t in enumerate(scheduler.timesteps.tolist()):
        sigma, sigma_to = sigmas[i], sigmas[i + 1]
        sigma_up = math.sqrt(sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2)
        sigma_down = math.sqrt(sigma_to**2 - sigma_up**2)
        dt = sigma_down - sigma
        ax, am = _x0_coeffs_karras(prediction, sigma)
        coeffs = (ax, am, INF, 1.0 + dt / sigma, 0.0, -dt / sigma, 0.0, sigma_up)
        rows.append(StepRow(float(t), _c_in(sigma), coeffs, draws_noise=True))
    return rows


def _alpha_sigma(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    alpha = 1.0 / torch.sqrt(sigma**2 + 1.0)
    return alpha, sigma * alpha


def dpmpp_steps(scheduler, start: int = 0) -> list[StepRow]:
    """DPM-Solver++ (multistep, order 1 or 2, midpoint or heun); history holds the previous x0.
    A run that begins at `start` (image-to-image) takes its first step at first order, as diffusers does."""
    config = scheduler.config
    sigmas = scheduler.sigmas.to(torch.float64)
    num = len(scheduler.timesteps)
    alphas, sigma_ts = _alpha_sigma(sigmas)
    lambdas = torch.log(alphas) - torch.log(sigma_ts)  # +inf where sigma is 0
    rows = []
    for i, t in enumerate(scheduler.timesteps.tolist()):
        alpha_s, sigma_s = alphas[i].item(), sigma_ts[i].item()
        if config.prediction_type == "epsilon":
            ax, am = 1.0 / alpha_s, -sigma_s / alpha_s
        elif config.prediction_type == "v_prediction":
            ax, am = alpha_s, -sigma_s
        elif config.prediction_type == "sample":
            ax, am = 0.0, 1.0
        else:
            raise ValueError(f"prediction_type {config.prediction_type!r} is not supported")
        lower_order_final = i == num - 1 and (
            config.euler_at_final or (config.lower_order_final and num < 15) or config.final_sigmas_type == "zero"
        )
        h = (lambdas[i + 1] - lambdas[i]).item()
        alpha_t, sigma_t = alphas[i + 1].item(), sigma_ts[i + 1].item()
        phi = alpha_t * (math.exp(-h) - 1.0)
        cs, cx, ch = sigma_t / sigma_s, -phi, 0.0
        if config.solver_order == 2 and i - start >= 1 and not lower_order_final:
            r0 = (lambdas[i] - lambdas[i - 1]).item() / h
            if config.solver_type == "midpoint":
                cx, ch = -phi - 0.5 * phi / r0, 0.5 * phi / r0
            else:  # heun
                psi = alpha_t * ((math.exp(-h) - 1.0) / h + 1.0)
                cx, ch = -phi + psi / r0, -psi / r0
        rows.append(StepRow(float(t), 1.0, (ax, am, INF, cs, 0.0, cx, ch, 0.0)))
    return rows
