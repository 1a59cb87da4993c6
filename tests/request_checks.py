"""One check the fidelity tests of per-request conditions share: a mixed batch through the engine, each request's
images (and latents) against its diffusers reference."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dvllm import SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4  # images in [0, 1], latents

Reference = Callable[[str, SamplingParams, str], Any]  # (prompt, params, output_type) -> the pipeline's images


def assert_each_request_matches(engine: Any, batch: list[tuple[str, SamplingParams]], reference: Reference) -> None:
    """The batch run together twice (images, then latents); each request equal to its reference, to TOL and
    LATENT_TOL."""
    for output_type, tol in (("np", TOL), ("latent", LATENT_TOL)):
        params = [SamplingParams(**{**vars(p), "output_type": output_type}) for _, p in batch]
        outs = engine.generate([q for q, _ in batch], params, use_tqdm=False)
        for (prompt, p), out in zip(batch, outs):
            assert out.error is None, out.error
            want = np.asarray(reference(prompt, p, output_type))
            got = np.stack([np.asarray(image) for image in out.images])
            assert got.shape == want.shape
            diff = float(np.abs(got - want).max())
            assert diff <= tol, f"{prompt!r} {output_type}: max abs diff {diff}"
