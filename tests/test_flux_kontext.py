"""FLUX.1 Kontext: each request's image equals FluxKontextPipeline's for that request alone (max_area=height*width:
dvllm serves the requested size), in a batch that mixes input images of other sizes (other token grids), n > 1 and
other guidance scales."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FluxKontextPipeline
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams


def tiny_flux_kontext_pipeline() -> FluxKontextPipeline:
    """tiny_flux_pipeline's parts with a VAE that downsamples 16x: the pipeline resizes every input image to about
    1024x1024 (the preferred Kontext resolutions), which must stay a few hundred image tokens on CPU."""
    from conftest import tiny_flux_pipeline

    flux = tiny_flux_pipeline()
    torch.manual_seed(3)
    vae = AutoencoderKL(
        block_out_channels=(4,) * 5, in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = FluxKontextPipeline(**{**flux.components, "vae": vae})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def kontext_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-flux-kontext")
    tiny_flux_kontext_pipeline().save_pretrained(path)
    return str(path)


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).random((size[1], size[0], 3))
    return Image.fromarray((pixels * 255).astype("uint8"))


def reference(pipe, prompt: str, p: SamplingParams) -> np.ndarray:
    return pipe(image=p.image, prompt=prompt, guidance_scale=p.guidance_scale,
                num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                max_area=p.height * p.width, num_images_per_prompt=p.n,
                generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images


def P(**kwargs) -> SamplingParams:
    return SamplingParams(**{"num_inference_steps": 3, "height": 32, "width": 32, "guidance_scale": 3.5,
                             "output_type": "np", **kwargs})


@pytest.mark.slow
def test_edits_of_other_input_sizes_share_steps_and_match_the_pipeline(kontext_path):
    tall, wide = picture(1, (64, 96)), picture(2, (96, 64))  # other aspects: other preferred resolutions and grids
    jobs = [
        ("make it red", P(image=tall, n=2, seed=1)),
        # another grid, guidance and step count; the same prompt with another image: the prompt cache serves it
        ("make it red", P(image=wide, seed=2, guidance_scale=2.5, num_inference_steps=4)),
        ("add a hat", P(image=tall, seed=3, guidance_scale=2.5)),
    ]
    pipe = DiffusionPipeline.from_pretrained(kontext_path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=kontext_path, device="cpu", dtype="float32")
    grids = {engine.model_info.input_grids(image) for image in (tall, wide)}
    assert len(grids) == 2
    outs = engine.generate([prompt for prompt, _ in jobs], [p for _, p in jobs], use_tqdm=False)
    worst = 0.0
    for (prompt, p), out in zip(jobs, outs):
        assert out.error is None, out.error
        expected = reference(pipe, prompt, p)
        assert len(out.images) == len(expected) == p.n
        for got, want in zip(out.images, expected):
            assert got.shape == want.shape == (32, 32, 3)
            worst = max(worst, float(np.abs(got - want).max()))
    print(f"largest difference from the pipeline: {worst:.2e}")
    assert worst <= 1e-3
    # the text encoding does not read the image: identical prompts share one encoding whatever their images
    assert engine.stats()["prompt_cache_hits"] == 1


def test_kontext_defaults_and_errors_name_the_field(kontext_path):
    engine = DiffusionEngine(model=kontext_path, device="cpu", dtype="float32")
    image = picture(1, (300, 200))
    params = SamplingParams(image=image).resolve(engine.model_info, engine.config)
    assert (params.height, params.width) == (1024, 1024)  # the pipeline's default, whatever the image
    bad = [
        (SamplingParams(), "image: this model \\(FluxKontextPipeline\\) edits images"),
        (SamplingParams(image=image, strength=0.5), "strength: FluxKontextPipeline conditions on its images"),
        (SamplingParams(image=[image, image]), "image: 2 images, but this model takes at most 1"),
        (SamplingParams(image=picture(1, (20, 64)), height=32), "image: 20x64 is smaller than 32 px on a side"),
    ]
    for p, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", "x", p)
    assert not engine.has_unfinished_requests()


def test_the_memory_profile_runs_the_worst_kontext_step(kontext_path):
    """The GPU pool sizing's worst step (run here with the memory queries faked): texts without the image, the
    image's encode, and a forward with the largest input state."""
    from dvllm.config import EngineConfig
    from dvllm.worker.memory_profile import step_peaks

    adapter = DiffusionEngine(model=kontext_path, device="cpu", dtype="float32").executor.worker.runner.adapter

    class Runs:
        def measure(self, run) -> int:
            run()
            return 1

    peaks = step_peaks(adapter, EngineConfig(max_batch_size=2, max_image_pixels=64 * 64), Runs())
    assert set(peaks) == {"encode", "denoise", "decode"}
