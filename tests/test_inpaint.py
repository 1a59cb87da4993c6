"""Inpainting: SD and SDXL, with regular (4-channel) and inpainting (9-channel) UNets. Each image equals
the diffusers inpainting pipeline's for that request alone, in a batch that mixes inpainting with
image-to-image and text-to-image requests, other samplers, strengths, guidance and n."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, StableDiffusionPipeline,
                       StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline,
                       UNet2DConditionModel)
from PIL import Image

from conftest import _saved, tiny_sd_pipeline, tiny_sdxl_pipeline
from dvllm import DiffusionEngine, SamplingParams
from dvllm.samplers import make_scheduler


def _inpainting_unet(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """The same UNet config with 9 input channels (latents, mask, masked-image latents), new random weights."""
    torch.manual_seed(7)
    return UNet2DConditionModel.from_config({**unet.config, "in_channels": 9})


@pytest.fixture(scope="session")
def sd_inpaint_path(tmp_path_factory) -> str:
    base = tiny_sd_pipeline()
    pipe = StableDiffusionInpaintPipeline(**{**base.components, "unet": _inpainting_unet(base.unet)})
    return _saved(tmp_path_factory, "tiny-sd-inpaint", pipe)


@pytest.fixture(scope="session")
def sdxl_inpaint_path(tmp_path_factory) -> str:
    base = tiny_sdxl_pipeline()
    pipe = StableDiffusionXLInpaintPipeline(**{**base.components, "unet": _inpainting_unet(base.unet)})
    return _saved(tmp_path_factory, "tiny-sdxl-inpaint", pipe)


# fixture -> (the folder's pipeline, the inpainting pipeline on its components, img2img's, 9-channel UNet)
MODELS = {
    "sd_eps_path": (StableDiffusionPipeline, StableDiffusionInpaintPipeline, StableDiffusionImg2ImgPipeline, False),
    "sdxl_path": (StableDiffusionXLPipeline, StableDiffusionXLInpaintPipeline, StableDiffusionXLImg2ImgPipeline,
                  False),
    "sd_inpaint_path": (StableDiffusionInpaintPipeline, StableDiffusionInpaintPipeline, None, True),
    "sdxl_inpaint_path": (StableDiffusionXLInpaintPipeline, StableDiffusionXLInpaintPipeline, None, True),
}


def picture(seed: int, size: tuple[int, int] = (32, 24)) -> Image.Image:
    pixels = np.random.default_rng(seed).random((size[1], size[0], 3))
    return Image.fromarray((pixels * 255).astype("uint8"))


def mask(size: tuple[int, int] = (32, 24), box: tuple[int, int, int, int] = (6, 4, 26, 18)) -> Image.Image:
    """White (repaint) inside the box, with grey edges on both sides of 0.5 to test the binarization."""
    m = np.zeros((size[1], size[0]), np.uint8)
    left, top, right, bottom = box
    m[top:bottom, left:right] = 255
    m[top, left:right] = 140  # above 0.5: repainted
    m[min(bottom, size[1] - 1), left:right] = 110  # below: kept
    return Image.fromarray(m)


def reference(pipe, engine: DiffusionEngine, prompt: str, p: SamplingParams) -> np.ndarray:
    base = pipe.scheduler
    if p.sampler:
        pipe.scheduler = make_scheduler(engine.model_info.schedule.config, p.sampler)
    extra = {k: getattr(p, k) for k in ("strength", "height", "width", "mask_image") if getattr(p, k) is not None}
    try:
        return pipe(prompt, image=p.image, num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                    negative_prompt=p.negative_prompt, num_images_per_prompt=p.n, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(p.seed), **extra).images
    finally:
        pipe.scheduler = base


@pytest.mark.parametrize("fixture", sorted(MODELS))
@pytest.mark.slow
def test_inpainting_in_a_mixed_batch_matches_the_inpainting_pipeline(fixture, request):
    path = request.getfixturevalue(fixture)
    folder_class, inpaint_class, img2img_class, nine_channels = MODELS[fixture]
    loaded = folder_class.from_pretrained(path)
    inpaint = inpaint_class.from_pipe(loaded)
    img2img = img2img_class.from_pipe(loaded) if img2img_class else None
    for pipe in (inpaint, img2img):
        if pipe is not None:
            pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    P = SamplingParams
    jobs = [
        # the default strength (1.0; SDXL's 0.9999) and size (the model's), CFG, two images
        ("a red circle", P(image=picture(1), mask_image=mask(), num_inference_steps=6, guidance_scale=5.0, seed=1,
                           n=2, negative_prompt="blurry")),
        # a sampler that draws noise every step, a strength below 1, no CFG
        ("a blue square", P(image=picture(2), mask_image=mask(box=(0, 0, 16, 24)), strength=0.7, seed=2,
                            num_inference_steps=8, guidance_scale=1.0, sampler="euler_a")),
        # a multistep sampler, the image's own size asked for
        ("a green star", P(image=picture(3), mask_image=mask(box=(10, 2, 30, 22)), strength=1.0, seed=3,
                           num_inference_steps=7, guidance_scale=4.0, sampler="dpmpp_2m", height=24, width=32)),
    ]
    if not nine_channels:  # a regular UNet also serves image-to-image and text-to-image in the same forwards
        default = engine.model_info.defaults.height, engine.model_info.defaults.width
        jobs += [("img2img", P(image=picture(4, default[::-1]), strength=0.6, num_inference_steps=6, seed=4,
                               guidance_scale=3.0)),
                 ("text to image", P(num_inference_steps=5, seed=5, guidance_scale=5.0))]
    params = [SamplingParams(**{**p.__dict__, "output_type": "np"}) for _, p in jobs]
    outs = engine.generate([prompt for prompt, _ in jobs], params, use_tqdm=False)
    for (prompt, _), p, out in zip(jobs, params, outs):
        assert out.error is None, out.error
        if p.image is None:
            assert len(out.images) == 1
            continue
        expected = reference(inpaint if p.mask_image is not None else img2img, engine, prompt, p)
        assert len(out.images) == len(expected) == p.n
        for got, want in zip(out.images, expected):
            assert got.shape == want.shape
            assert float(np.abs(got - want).max()) <= 1e-3
    # the default size is the model's, not the image's (the pipeline resizes the image to it)
    info = engine.model_info
    assert outs[0].images[0].shape == (info.defaults.height, info.defaults.width, 3)
    assert outs[2].images[0].shape == (24, 32, 3)
    # inpainting changes the image: outside the mask a regular UNet keeps it (close: decoded latents)
    if not nine_channels:
        third = outs[2].images[0]
        known = np.asarray(picture(3), dtype=np.float32) / 255
        keep = np.asarray(mask(box=(10, 2, 30, 22))) < 128
        assert np.abs(third - known)[~keep].mean() > np.abs(third - known)[keep].mean()


def test_a_mask_changes_only_what_the_pipeline_changes(sd_eps_path):
    """Two masks, same seed: the images differ, and each still equals its pipeline (the mask is honoured)."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    params = [SamplingParams(image=picture(1), mask_image=mask(box=box), num_inference_steps=4, seed=1,
                             output_type="np", height=24, width=32) for box in ((0, 0, 8, 8), (0, 0, 32, 24))]
    a, b = engine.generate(["x", "x"], params, use_tqdm=False)
    assert float(np.abs(a.images[0] - b.images[0]).max()) > 0.05


@pytest.mark.slow
def test_inpainting_errors_name_the_field(sd_eps_path, sd_inpaint_path, qwen_image_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    bad = [
        (SamplingParams(mask_image=mask()), "mask_image needs an image"),
        (SamplingParams(image=picture(1), mask_image=mask(size=(16, 16))), "mask_image must be the size of image"),
        (SamplingParams(image=picture(1), mask_image=42), "mask_image: expected a PIL image"),
        (SamplingParams(image=picture(1), mask_image="/nonexistent/mask.png"), "mask_image: cannot read it"),
        (SamplingParams(image=[picture(1), picture(2)], mask_image=mask()), "image: 2 images, but this model"),
        (SamplingParams(image=picture(1), mask_image=mask(), height=20), "height must be a positive multiple of 8"),
    ]
    for params, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.generate(["x"], [params], use_tqdm=False)
    nine = DiffusionEngine(model=sd_inpaint_path, device="cpu", dtype="float32")
    for params in (SamplingParams(), SamplingParams(image=picture(1))):
        with pytest.raises(ValueError, match="only inpaints: send an image and a mask"):
            nine.generate(["x"], [params], use_tqdm=False)
    qwen = DiffusionEngine(model=qwen_image_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="image"):
        qwen.generate(["x"], [SamplingParams(image=picture(1), mask_image=mask())], use_tqdm=False)


def test_inpainting_survives_preemption(sd_eps_path):
    """A preempted inpainting request takes its mask and latents to host memory and back: the same image."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_batch_size=1,
                             scheduling_policy="priority")
    low = SamplingParams(image=picture(1), mask_image=mask(), num_inference_steps=6, seed=1, output_type="np",
                         sampler="euler_a", strength=0.8, guidance_scale=1.0, priority=5)
    alone = engine.generate(["x"], [low], use_tqdm=False)[0].images[0]
    engine.add_request("low", "x", low)
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", "y", SamplingParams(num_inference_steps=3, seed=2, output_type="np",
                                                     guidance_scale=1.0, priority=0))
    outs = {}
    while len(outs) < 2:
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outs[out.request_id] = out
    assert engine.stats()["num_preemptions"] >= 1
    assert float(np.abs(outs["low"].images[0] - alone).max()) <= 1e-6
