"""EngineConfig.vae_dtype: the VAE in a dtype of its own (a float32 VAE under a half-precision denoiser, as
users run SD 1.5's fp16-overflowing VAE), its latents cast in and out at encode and decode."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from test_flux_kontext import tiny_flux_kontext_pipeline

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.models.loader import load_adapter


def run(path: str, params: SamplingParams, **kwargs) -> np.ndarray | torch.Tensor:
    out = DiffusionEngine(model=path, device="cpu", dtype="float32", **kwargs).generate(
        ["a red circle"], [params], use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.images[0]


@pytest.mark.slow
def test_a_bfloat16_vae_decodes_the_float32_denoisers_latents_as_diffusers_would(sd_eps_path):
    latents = run(sd_eps_path, SamplingParams(num_inference_steps=3, seed=1, height=16, width=16,
                                              output_type="latent"))
    got = run(sd_eps_path, SamplingParams(num_inference_steps=3, seed=1, height=16, width=16, output_type="np"),
              vae_dtype="bfloat16")
    pipe = StableDiffusionPipeline.from_pretrained(sd_eps_path, safety_checker=None, requires_safety_checker=False)
    vae = pipe.vae.to(torch.bfloat16)
    with torch.no_grad():
        decoded = vae.decode(latents[None].to(torch.bfloat16) / vae.config.scaling_factor, return_dict=False)[0]
    want = pipe.image_processor.postprocess(decoded, output_type="np")[0]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    full = run(sd_eps_path, SamplingParams(num_inference_steps=3, seed=1, height=16, width=16, output_type="np"))
    assert np.abs(got - full).max() > 0  # the bfloat16 VAE ran


@pytest.mark.parametrize("fixture", ["sd_eps_path", "sdxl_path", "sd3_path", "flux_path", "qwen_image_path",
                                     "z_image_path"])
@pytest.mark.slow
def test_every_family_decodes_with_a_vae_of_another_dtype(request, fixture):
    path = request.getfixturevalue(fixture)
    params = SamplingParams(num_inference_steps=2, seed=3, output_type="np",
                            **({"height": 16, "width": 16} if fixture in ("sd_eps_path", "sdxl_path") else
                               {"height": 32, "width": 32}))
    full, half = run(path, params), run(path, params, vae_dtype="bfloat16")
    assert np.isfinite(half).all() and 0 < np.abs(half - full).max() < 0.1  # bfloat16's rounding, no more


@pytest.mark.parametrize("fixture", ["sd_eps_path", "qwen_image_edit_path"])
@pytest.mark.slow
def test_image_inputs_encode_through_a_vae_of_another_dtype(request, fixture):
    path = request.getfixturevalue(fixture)
    picture = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    params = SamplingParams(num_inference_steps=2, seed=3, height=32, width=32, output_type="np", image=picture,
                            **({"strength": 0.6} if fixture == "sd_eps_path" else {}))
    full, half = run(path, params), run(path, params, vae_dtype="bfloat16")
    assert np.isfinite(half).all() and 0 < np.abs(half - full).max() < 0.1


def test_a_pipeline_that_encodes_in_the_denoisers_dtype_refuses_another(tmp_path):
    tiny_flux_kontext_pipeline().save_pretrained(tmp_path)
    adapter = load_adapter(str(tmp_path), "auto", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="vae_dtype: the flux-kontext pipeline encodes its input images"):
        adapter.place_vae(torch.bfloat16)


def test_an_unknown_vae_dtype_is_refused():
    with pytest.raises(ValueError, match="vae_dtype"):
        EngineConfig(vae_dtype="fp8")
