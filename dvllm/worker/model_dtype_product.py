"""The model output's x0 term as diffusers forms it when the denoiser's dtype is not the latents'.

Wan keeps float32 latents beside a bfloat16 transformer. UniPC and DPM-Solver++ then predict x0 as
`sample - sigma_t * model_output`, where sigma_t is a float32 0-dim tensor: torch forms that product in the
output's dtype (and on the CPU casts sigma_t to it first, on CUDA keeps it as a float scalar), and only the
subtraction is float32. The fused update's float32 `AM * model_output` would skip that rounding, so these rows'
products are formed here by the same expression, per request, and handed to the update with AM = 1.
"""
from __future__ import annotations

import torch

from dvllm.ops import AM


def x0_terms(out: torch.Tensor, coeffs: torch.Tensor, scales: list[float],
             bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, coeffs) for the update: out [R, numel] in the output's dtype becomes float32 AM * out, formed per
    request [lo, hi) with its host-side AM (`scales`) as diffusers forms it, and coeffs' AM column becomes 1."""
    terms = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    for scale, (lo, hi) in zip(scales, bounds):
        # a CPU 0-dim float32 tensor, as the scheduler's sigma is: no copy to the device, no sync
        terms[lo:hi] = torch.tensor(scale, dtype=torch.float32) * out[lo:hi]
    coeffs = coeffs.clone()
    coeffs[:, AM] = 1.0
    return terms, coeffs
