"""dvllm's tensor ops with their pure-torch reference.

`sampler_update` is the one update every vectorized sampler reduces to. Each row r
carries its own coefficients (one row of `coeffs`, laid out as the indices below):

    x0   = clamp(ax * sample + am * model_output, -clip, clip)
    prev = cs * sample + cm * model_output + cx * x0 + ch * history + cn * noise

x0 is the row's prediction of the clean latent (DPM-Solver keeps it as history, and
previews decode it). DDIM, Euler, Euler ancestral, DPM-Solver++ (1st/2nd order) and
LCM are exactly this form with step-dependent coefficients; see dvllm/samplers.
"""
from __future__ import annotations

import torch

AX, AM, CLIP, CS, CM, CX, CH, CN = range(8)
NUM_COEFFS = 8


def sampler_update(
    sample: torch.Tensor,        # [R, C, H, W] current latents
    model_output: torch.Tensor,  # [R, C, H, W] guided denoiser output
    coeffs: torch.Tensor,        # [R, NUM_COEFFS] float32
    history: torch.Tensor | None = None,  # [R, C, H, W] previous x0 (multistep), or None
    noise: torch.Tensor | None = None,    # [R, C, H, W] ancestral noise, or None
    clip: bool = False,          # whether any row clamps x0 (skips the clamp otherwise)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (prev_sample, x0), both float32."""
    c = coeffs.to(torch.float32)[:, :, None, None, None]
    sample = sample.to(torch.float32)
    model_output = model_output.to(torch.float32)
    x0 = c[:, AX] * sample + c[:, AM] * model_output
    if clip:
        x0 = torch.maximum(torch.minimum(x0, c[:, CLIP]), -c[:, CLIP])
    prev = c[:, CS] * sample + c[:, CM] * model_output + c[:, CX] * x0
    if history is not None:
        prev = prev + c[:, CH] * history.to(torch.float32)
    if noise is not None:
        prev = prev + c[:, CN] * noise.to(torch.float32)
    return prev, x0
