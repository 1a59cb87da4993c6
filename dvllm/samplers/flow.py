"""Coefficients for flow matching's Euler scheduler (SD3, Flux, Qwen-Image, Z-Image).

The model predicts a velocity v; x0 = x - sigma * v. Deterministic steps move along it,
x' = x + (sigma_next - sigma) * v; stochastic sampling re-noises x0 to sigma_next.
"""
from __future__ import annotations

from dvllm.samplers.plan import StepRow

INF = float("inf")


def flow_euler_steps(scheduler, start: int = 0) -> list[StepRow]:
    sigmas = scheduler.sigmas.tolist()
    stochastic = scheduler.config.stochastic_sampling
    rows = []
    for i, t in enumerate(scheduler.timesteps.tolist()):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        if stochastic:
            coeffs = (1.0, -sigma, INF, 0.0, 0.0, 1.0 - sigma_next, 0.0, sigma_next)
        else:
            coeffs = (1.0, -sigma, INF, 1.0, sigma_next - sigma, 0.0, 0.0, 0.0)
        rows.append(StepRow(float(t), 1.0, coeffs, draws_noise=stochastic))
    return rows
