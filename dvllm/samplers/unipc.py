"""Coefficients for UniPC (UniPCMultistepScheduler), Wan's own sampler: its predictor and corrector at
orders 1-3, x0 prediction (predict_x0), the B(h) variants bh1 and bh2, flow or Karras sigmas.

diffusers steps a request as: correct this step's sample with this step's x0 and the last few (UniC, unless
disabled there), then predict the next sample from the corrected one (UniP). Both are linear in the sample
and the x0 predictions. The corrected sample is never stored: the predictor of the step before and this
step's corrector start from the same point, so the corrected sample is this step's sample plus the
difference of their two correction terms, which only weigh x0 predictions. One step is then

    prev = CS * sample + CX * x0 + sum over the last `solver_order` steps' x0 of their weights,

the fused update's form, with the earlier x0 in `solver_order` history slots.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from dvllm.samplers.multistep import alpha_sigma, by_slot, log_snr, x0_coeffs
from dvllm.samplers.plan import StepRow, update_coeffs

SAMPLE, X0 = 0, 1  # a step's linear terms: the sample, then the x0 of `age` steps ago at X0 + age
_TERMS = 2 + 3     # ... up to three steps ago (solver_order 3's corrector)


def unipc_ok(config: Any) -> bool:
    """Whether the vectorized update covers this configuration (the rest is stepped by diffusers)."""
    return (config.predict_x0 and not config.thresholding and config.solver_p is None
            and config.solver_type in ("bh1", "bh2") and 1 <= config.solver_order <= 3
            and config.prediction_type in ("epsilon", "v_prediction", "sample", "flow_prediction"))


def unipc_steps(scheduler: Any, start: int = 0) -> list[StepRow]:
    """A run that begins at `start` (image-to-image) warms its order up from there, as diffusers does."""
    config = scheduler.config
    solver = _Solver(config, [float(s) for s in scheduler.sigmas.tolist()])
    num, order = len(scheduler.timesteps), config.solver_order
    rows, last_order = [], 1
    for i, t in enumerate(scheduler.timesteps.tolist()):
        done = max(i - start, 0)  # steps this run has taken (rows before `start` are not used)
        corrected = _unit(SAMPLE)
        if done > 0 and i - 1 not in config.disable_corrector:
            corrected = corrected + solver.correction(i, last_order)
        this_order = min(order, num - i) if config.lower_order_final else order
        this_order = min(this_order, min(done, order) + 1)  # the warm-up: no more earlier x0 than it has
        terms = solver.predict(i, this_order, corrected)
        last_order = this_order
        ax, am = x0_coeffs(config.prediction_type, config, solver.sigmas[i])
        history = by_slot(terms[X0 + 1:X0 + 1 + order].tolist(), order)
        rows.append(StepRow(float(t), 1.0, update_coeffs(ax, am, cs=terms[SAMPLE], cx=terms[X0], history=history)))
    return rows


def _unit(term: int) -> np.ndarray:
    v = np.zeros(_TERMS)
    v[term] = 1.0
    return v


class _Solver:
    """diffusers' UniP and UniC steps, each as a vector of weights over the terms (SAMPLE, X0 + age)."""

    def __init__(self, config: Any, sigmas: list[float]) -> None:
        self.config, self.sigmas = config, sigmas
        self.lambdas = [log_snr(config, s) for s in sigmas]

    def predict(self, i: int, order: int, corrected: np.ndarray) -> np.ndarray:
        """UniP from index i to i + 1 of the schedule, at `order`, starting from the corrected sample."""
        alpha_t, sigma_t = alpha_sigma(self.config, self.sigmas[i + 1])
        sigma_s0 = alpha_sigma(self.config, self.sigmas[i])[1]
        h, rks, h_phi_1, b_h = self._span(i, order)
        out = sigma_t / sigma_s0 * corrected - alpha_t * h_phi_1 * _unit(X0)
        for age, (r, rho) in enumerate(zip(rks, self._rhos(h, rks, order, corrector=False)), start=1):
            out -= alpha_t * b_h * rho * (_unit(X0 + age) - _unit(X0)) / r
        return out

    def correction(self, i: int, order: int) -> np.ndarray:
        """The corrected sample at index i minus the sample (the predictor's result from i - 1): UniC's
        correction terms less UniP's, over the same span and earlier x0."""
        alpha_t = alpha_sigma(self.config, self.sigmas[i])[0]
        h, rks, _, b_h = self._span(i - 1, order)
        rhos_p, rhos_c = self._rhos(h, rks, order, corrector=False), self._rhos(h, rks, order, corrector=True)
        out = np.zeros(_TERMS)
        for age, r in enumerate(rks, start=1):  # earlier x0 measured from the last step's (age 1 here)
            d1 = (_unit(X0 + age + 1) - _unit(X0 + 1)) / r
            out += alpha_t * b_h * (rhos_p[age - 1] - rhos_c[age - 1]) * d1
        return out - alpha_t * b_h * rhos_c[-1] * (_unit(X0) - _unit(X0 + 1))

    def _span(self, i: int, order: int) -> tuple[float, list[float], float, float]:
        """h, the earlier steps' r_k, h * phi_1(h) and B(h) of a step from index i to i + 1."""
        lam = self.lambdas
        h = lam[i + 1] - lam[i]
        rks = [(lam[i - k] - lam[i]) / h for k in range(1, order)]
        hh = -h  # predict_x0
        b_h = hh if self.config.solver_type == "bh1" else math.expm1(hh)
        return h, rks, math.expm1(hh), b_h

    def _rhos(self, h: float, rks: list[float], order: int, corrector: bool) -> list[float]:
        """UniPC's weights of the differences: solved from its order conditions; order 2's predictor and
        order 1's corrector take diffusers' fixed 0.5."""
        if corrector and order == 1:
            return [0.5]
        if not corrector and order <= 2:
            return [0.5] * (order - 1)
        hh = -h
        b_h = hh if self.config.solver_type == "bh1" else math.expm1(hh)
        h_phi_k, factorial = math.expm1(hh) / hh - 1.0, 1
        R, b = [], []
        for k in range(1, order + 1):
            R.append([r ** (k - 1) for r in [*rks, 1.0]])
            b.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1.0 / factorial
        R, b = np.array(R), np.array(b)
        return np.linalg.solve(R, b).tolist() if corrector else np.linalg.solve(R[:-1, :-1], b[:-1]).tolist()
