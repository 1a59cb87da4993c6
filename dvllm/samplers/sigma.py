"""Coefficients for the schedulers that step on sigmas: Euler, Euler ancestral, DPM-Solver++."""
from __future__ import annotations

import math

import numpy as np

from dvllm.samplers.multistep import alpha_sigma, by_slot, log_snr, x0_coeffs
from dvllm.samplers.plan import StepRow, update_coeffs

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


def dpmpp_steps(scheduler, start: int = 0) -> list[StepRow]:
    """DPM-Solver++ (multistep, orders 1-3; order 2 midpoint or heun), Karras or flow sigmas; its history slots
    hold the last solver_order - 1 x0. A run that begins at `start` (image-to-image) warms its order up from
    there, as diffusers does."""
    config = scheduler.config
    sigmas = [float(s) for s in scheduler.sigmas.tolist()]
    lam = [log_snr(config, s) for s in sigmas]
    num, order = len(scheduler.timesteps), config.solver_order
    rows = []
    for i, t in enumerate(scheduler.timesteps.tolist()):
        done = max(i - start, 0)  # steps this run has taken (rows before `start` are not used)
        ax, am = x0_coeffs(config.prediction_type, config, sigmas[i])
        lower_order_final = i == num - 1 and (
            config.euler_at_final or (config.lower_order_final and num < 15) or config.final_sigmas_type == "zero"
        )
        lower_order_second = i == num - 2 and config.lower_order_final and num < 15
        alpha_t, sigma_t = alpha_sigma(config, sigmas[i + 1])
        h = lam[i + 1] - lam[i]
        phi = alpha_t * (math.exp(-h) - 1.0)
        cs, cx, by_age = sigma_t / alpha_sigma(config, sigmas[i])[1], -phi, [0.0, 0.0]
        if order == 1 or done < 1 or lower_order_final:
            pass  # first order: the x0 alone
        elif order == 2 or done < 2 or lower_order_second:
            r0 = (lam[i] - lam[i - 1]) / h
            if config.solver_type == "midpoint":
                cx, by_age[0] = -phi - 0.5 * phi / r0, 0.5 * phi / r0
            else:  # heun
                psi = alpha_t * ((math.exp(-h) - 1.0) / h + 1.0)
                cx, by_age[0] = -phi + psi / r0, -psi / r0
        else:  # third order, over this x0 and the last two
            r0, r1 = (lam[i] - lam[i - 1]) / h, (lam[i - 1] - lam[i - 2]) / h
            d1_0, d1_1 = np.array([1.0, -1.0, 0.0]) / r0, np.array([0.0, 1.0, -1.0]) / r1
            d1 = d1_0 + r0 / (r0 + r1) * (d1_0 - d1_1)
            d2 = (d1_0 - d1_1) / (r0 + r1)
            psi = alpha_t * ((math.exp(-h) - 1.0) / h + 1.0)
            terms = -phi * np.array([1.0, 0.0, 0.0]) + psi * d1 - alpha_t * ((math.exp(-h) - 1.0 + h) / h**2 - 0.5) * d2
            cx, by_age = float(terms[0]), terms[1:].tolist()
        history = by_slot(by_age[:order - 1], order - 1)
        rows.append(StepRow(float(t), 1.0, update_coeffs(ax, am, cs=cs, cx=cx, history=history)))
    return rows
