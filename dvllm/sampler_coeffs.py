"""The layout of the sampler update's per-row coefficients: defined here only.

dvllm/ops.py's `sampler_update` and its reference read a row's coefficients by these indices, the
samplers write them, and the C++ and CUDA kernels in csrc/ get the same list at build time
(dvllm/_extension.py passes it as DVLLM_COEFFS), so the three can never disagree.

    x0   = clamp(AX * sample + AM * model_output, -CLIP, CLIP)
    prev = CS * sample + CM * model_output + CX * x0 + CH * history + CN * noise
"""
from __future__ import annotations

import enum


class Coeff(enum.IntEnum):
    AX = 0    # x0: weight of the sample
    AM = 1    # x0: weight of the model output
    CLIP = 2  # x0 is clamped to [-CLIP, CLIP] (inf: no clamp)
    CS = 3    # prev: weight of the sample
    CM = 4    # prev: weight of the model output
    CX = 5    # prev: weight of x0
    CH = 6    # prev: weight of the history (the previous x0, multistep samplers)
    CN = 7    # prev: weight of the noise (ancestral samplers)


NUM_COEFFS = len(Coeff)


def c_enumerators() -> str:
    """The names in index order, as the kernels' enum takes them: "AX,AM,...,CN"."""
    assert [c.value for c in Coeff] == list(range(NUM_COEFFS))  # the kernels' enum counts from 0
    return ",".join(c.name for c in Coeff)
