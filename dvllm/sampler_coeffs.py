"""The layout of the sampler update's per-row coefficients: defined here only.

dvllm/ops.py's `sampler_update` and its reference read a row's coefficients by these indices, the
samplers write them, and the C++ and CUDA kernels in csrc/ include a header generated from this file at
build time (`dvllm_coeffs.h`, written by setup.py's build or dvllm/_extension.py's), so the three can never
disagree. Each kernel library also reports the layout it was compiled with (`coeff_layout`,
`cuda_coeff_layout`), which tests compare with this file; and records it in its build info, which the loader
reads before it loads the library (kernel_sources.py).

    x0   = clamp(AX * sample + AM * model_output, -CLIP, CLIP)
    prev = CS * sample + CM * model_output + CX * x0 + CN * noise + CH * history[0] + CH1 * history[1] + ...

A multistep sampler keeps up to MAX_HISTORY earlier x0 per row (its history slots, oldest first: the step
writes its x0 over slot 0, which holds the oldest). CH, CH1, CH2 weigh slots 0, 1, 2.
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
    CH = 6    # prev: weight of history slot 0 (the oldest earlier x0 a multistep sampler keeps)
    CN = 7    # prev: weight of the noise (ancestral samplers)
    CH1 = 8   # prev: weight of history slot 1
    CH2 = 9   # prev: weight of history slot 2


HISTORY_COEFFS = (Coeff.CH, Coeff.CH1, Coeff.CH2)  # by history slot
MAX_HISTORY = len(HISTORY_COEFFS)


NUM_COEFFS = len(Coeff)


def layout() -> list[int]:
    """Each coefficient's index in name order, then NUM_COEFFS: what the kernels' coeff_layout ops return."""
    return [c.value for c in Coeff] + [NUM_COEFFS]


def c_header() -> str:
    """`dvllm_coeffs.h`, which csrc/ includes. (A list passed as one -D value would not do: nvcc splits a -D
    value at its commas, and the CUDA kernels then saw an enum of one name.)"""
    assert [c.value for c in Coeff] == list(range(NUM_COEFFS))  # the kernels index rows of NUM_COEFFS
    names = ", ".join(c.name for c in Coeff)
    return (
        "// Generated at build time from dvllm/sampler_coeffs.py: do not edit.\n"
        "#pragma once\n\n"
        "namespace dvllm {\n\n"
        "// Columns of scatter_update's coeffs [R, NUM_COEFFS].\n"
        f"enum Coeff : int {{ {', '.join(f'{c.name} = {c.value}' for c in Coeff)}, NUM_COEFFS = {NUM_COEFFS} }};\n\n"
        "// History slots weighed by " + ", ".join(c.name for c in HISTORY_COEFFS) + "; the update writes x0 to slot 0.\n"
        f"enum : int {{ MAX_HISTORY = {MAX_HISTORY} }};\n\n"
        "// The names in order, then NUM_COEFFS: what coeff_layout() returns.\n"
        f"#define DVLLM_COEFF_LAYOUT {{{names}, NUM_COEFFS}}\n\n"
        "}  // namespace dvllm\n"
    )
