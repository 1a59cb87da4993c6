"""--vae-tiling: the VAE decodes in overlapping tiles, as diffusers' enable_tiling, for sizes a GPU could not
decode whole; the images equal the diffusers pipeline's with tiling on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusers import StableDiffusionPipeline

from dvllm import DiffusionEngine, SamplingParams


@pytest.mark.slow
def test_tiled_decodes_equal_the_pipelines_with_tiling_on(sd_eps_path):
    params = SamplingParams(num_inference_steps=3, seed=5, height=64, width=64, guidance_scale=4.0, output_type="np")
    engines = {tiling: DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", vae_tiling=tiling,
                                       max_image_pixels=64 * 64) for tiling in (False, True)}
    vae = engines[True].executor.worker.runner.adapter.pipeline.vae
    assert vae.use_tiling and 64 // 2 > vae.tile_latent_min_size  # this size decodes in tiles
    got = {t: e.generate(["a red circle"], [params], use_tqdm=False)[0].images[0] for t, e in engines.items()}
    pipe = StableDiffusionPipeline.from_pretrained(sd_eps_path, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    want = pipe("a red circle", num_inference_steps=3, height=64, width=64, guidance_scale=4.0, output_type="np",
                generator=torch.Generator("cpu").manual_seed(5)).images[0]
    np.testing.assert_allclose(got[True], want, atol=1e-3, rtol=0)
    assert float(np.abs(got[True] - got[False]).max()) > 1e-4  # the tiles' blending shows: tiling ran
