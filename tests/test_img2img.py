"""Image-to-image: the image is VAE-encoded at admission, noised to its strength's start step, and
then scheduled like any request. Each image equals the diffusers img2img pipeline's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (StableDiffusionImg2ImgPipeline, StableDiffusionPipeline, StableDiffusionXLImg2ImgPipeline,
                       StableDiffusionXLPipeline)
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams
from dvllm.samplers import make_scheduler

PIPELINES = {"sd_eps_path": (StableDiffusionPipeline, StableDiffusionImg2ImgPipeline),
             "sd_v_path": (StableDiffusionPipeline, StableDiffusionImg2ImgPipeline),
             "sdxl_path": (StableDiffusionXLPipeline, StableDiffusionXLImg2ImgPipeline)}


def start_image(seed: int, size: tuple[int, int] = (32, 24)) -> Image.Image:
    pixels = np.random.default_rng(seed).random((size[1], size[0], 3))
    return Image.fromarray((pixels * 255).astype("uint8"))


def reference(pipe, engine, prompt: str, p: SamplingParams) -> np.ndarray:
    base = pipe.scheduler
    if p.sampler:
        pipe.scheduler = make_scheduler(engine.model_info.schedule.config, p.sampler)
    try:
        return pipe(prompt, image=p.image, strength=p.strength, num_inference_steps=p.num_inference_steps,
                    guidance_scale=p.guidance_scale, negative_prompt=p.negative_prompt, num_images_per_prompt=p.n,
                    generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images
    finally:
        pipe.scheduler = base


@pytest.mark.parametrize("fixture", sorted(PIPELINES))
@pytest.mark.slow
def test_img2img_in_a_mixed_batch_matches_the_img2img_pipeline(fixture, request):
    path = request.getfixturevalue(fixture)
    text2img, img2img = PIPELINES[fixture]
    pipe = img2img.from_pipe(text2img.from_pretrained(path))
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    P = SamplingParams
    jobs = [
        ("a red circle", P(image=start_image(1), strength=0.6, num_inference_steps=8, guidance_scale=5.0, seed=1)),
        ("a blue square", P(image=start_image(2), strength=0.75, num_inference_steps=8, guidance_scale=4.0, seed=2,
                            sampler="dpmpp_2m", n=2, negative_prompt="blurry")),
        ("a green star", P(image=start_image(3), strength=0.5, num_inference_steps=10, guidance_scale=1.0, seed=3,
                           sampler="euler_a")),
        ("pndm", P(image=start_image(4), strength=0.9, num_inference_steps=6, guidance_scale=3.0, seed=4,
                   sampler="PNDMScheduler")),
        # a text-to-image request of the same size shares the forwards
        ("no image", P(num_inference_steps=6, guidance_scale=5.0, seed=5, height=24, width=32)),
    ]
    params = [SamplingParams(**{**p.__dict__, "output_type": "np"}) for _, p in jobs]
    outs = engine.generate([prompt for prompt, _ in jobs], params, use_tqdm=False)
    for (prompt, _), p, out in zip(jobs, params, outs):
        assert out.error is None, out.error
        if p.image is None:
            continue
        expected = reference(pipe, engine, prompt, p)
        assert len(out.images) == len(expected) == p.n
        for got, want in zip(out.images, expected):
            assert got.shape == want.shape == (24, 32, 3)
            assert float(np.abs(got - want).max()) <= 1e-3
    assert outs[0].num_inference_steps == 4  # int(8 * 0.6) of the 8 steps run


def test_strength_and_image_errors_name_the_field(sd_eps_path, tmp_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_image_pixels=64 * 64)
    bad = [
        (SamplingParams(image=start_image(1), strength=0.0), "strength must be in"),
        (SamplingParams(image=start_image(1), strength=1.5), "strength must be in"),
        (SamplingParams(strength=0.5), "strength needs an image"),
        (SamplingParams(image=42), "image: expected a PIL image"),
        (SamplingParams(image=np.zeros((8, 8), dtype=np.uint8)), "image: an array must be HxWx3 uint8"),
        (SamplingParams(image=str(tmp_path / "missing.png")), "image: cannot read it"),
        (SamplingParams(image=start_image(1, (128, 128))), "image: 128x128 is over max_image_pixels"),
        (SamplingParams(image=start_image(1, (4, 4))), "image: 4x4 is smaller than 8 px"),
        (SamplingParams(image=start_image(1), strength=0.05, num_inference_steps=4), "strength=0.05 leaves no step"),
    ]
    (tmp_path / "not_an_image.png").write_text("hello")
    bad.append((SamplingParams(image=str(tmp_path / "not_an_image.png")), "image: cannot read it"))
    for params, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", "x", params)
    assert not engine.has_unfinished_requests()


def test_flow_families_refuse_an_image(flux_path):
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="image-to-image is not supported for the flux family"):
        engine.add_request("r", "x", SamplingParams(image=start_image(1)))


@pytest.mark.slow
def test_an_image_size_is_rounded_to_the_vae_scale_factor_as_the_pipeline_does(sd_eps_path):
    """The tiny VAE's scale factor is 2: a 35x27 image runs at 34x26, as the img2img pipeline's image
    processor rounds it (not at the text-to-image size factor, 8)."""
    pipe = StableDiffusionImg2ImgPipeline.from_pipe(StableDiffusionPipeline.from_pretrained(sd_eps_path))
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    params = SamplingParams(image=start_image(7, (35, 27)), strength=0.7, num_inference_steps=5, guidance_scale=4.0,
                            seed=7, output_type="np")
    out = engine.generate("an odd size", params, use_tqdm=False)[0]
    assert out.error is None, out.error
    expected = reference(pipe, engine, "an odd size", params)
    assert out.images[0].shape == expected[0].shape == (26, 34, 3)
    assert float(np.abs(out.images[0] - expected[0]).max()) <= 1e-3
