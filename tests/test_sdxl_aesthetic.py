"""SDXL UNets trained with an aesthetic score (requires_aesthetics_score): the refiner (its img2img class, one text
encoder) and an inpainting pipeline of that kind (as diffusers' own test components for it are). Each request's
score conditions its prompt rows, its negative score its negative rows; each image equals the diffusers pipeline's
with those scores, in a batch mixing scores, guidance, samplers and n."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import _saved, tiny_sdxl_pipeline
from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline, UNet2DConditionModel
from test_inpaint import mask, picture

from dvllm import DiffusionEngine, SamplingParams
from dvllm.samplers import make_scheduler


def _aesthetic_unet(cross_attention_dim: int) -> UNet2DConditionModel:
    """The tiny SDXL UNet with five time ids (original size, crop, score) instead of six."""
    torch.manual_seed(11)
    base = tiny_sdxl_pipeline().unet.config
    return UNet2DConditionModel.from_config({**base, "projection_class_embeddings_input_dim": 5 * 8 + 24,
                                             "cross_attention_dim": cross_attention_dim})


@pytest.fixture(scope="module")
def refiner_path(tmp_path_factory) -> str:
    """As the SDXL refiner's folder: StableDiffusionXLImg2ImgPipeline, no first text encoder."""
    base = tiny_sdxl_pipeline()
    pipe = StableDiffusionXLImg2ImgPipeline(
        vae=base.vae, text_encoder=None, text_encoder_2=base.text_encoder_2, tokenizer=None,
        tokenizer_2=base.tokenizer_2, unet=_aesthetic_unet(24), scheduler=base.scheduler,
        requires_aesthetics_score=True, force_zeros_for_empty_prompt=False, add_watermarker=False)
    return _saved(tmp_path_factory, "tiny-sdxl-refiner", pipe)


@pytest.fixture(scope="module")
def aesthetic_inpaint_path(tmp_path_factory) -> str:
    base = tiny_sdxl_pipeline()
    pipe = StableDiffusionXLInpaintPipeline(**{**base.components, "unet": _aesthetic_unet(48)},
                                            requires_aesthetics_score=True)
    return _saved(tmp_path_factory, "tiny-sdxl-aesthetic-inpaint", pipe)


def _reference(pipe, engine: DiffusionEngine, prompt: str, p: SamplingParams) -> np.ndarray:
    base = pipe.scheduler
    if p.sampler:
        pipe.scheduler = make_scheduler(engine.model_info.schedule.config, p.sampler)
    extra = {} if p.mask_image is None else {"mask_image": p.mask_image, "height": 24, "width": 32}
    scores = {k: v for k, v in (("aesthetic_score", p.aesthetic_score),
                                ("negative_aesthetic_score", p.negative_aesthetic_score)) if v is not None}
    try:
        return pipe(prompt, image=p.image, strength=p.strength, num_inference_steps=p.num_inference_steps,
                    guidance_scale=p.guidance_scale, negative_prompt=p.negative_prompt, num_images_per_prompt=p.n,
                    generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np", **scores,
                    **extra).images
    finally:
        pipe.scheduler = base


@pytest.mark.parametrize("fixture, pipeline_class, inpaint", [
    ("refiner_path", StableDiffusionXLImg2ImgPipeline, False),
    ("aesthetic_inpaint_path", StableDiffusionXLInpaintPipeline, True),
], ids=["refiner", "inpaint"])
@pytest.mark.slow
def test_each_request_scores_its_rows_as_the_pipeline_does(fixture, pipeline_class, inpaint, request):
    path = request.getfixturevalue(fixture)
    pipe = pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    assert engine.model_info.images.aesthetic_scores
    P = SamplingParams
    m = mask() if inpaint else None
    size = {"height": 24, "width": 32} if inpaint else {}  # (inpainting's default size is the model's)
    jobs = [  # the pipeline's default scores; others; no CFG; another sampler and two images
        ("a red circle", P(image=picture(1), mask_image=m, strength=0.6, num_inference_steps=6, guidance_scale=5.0,
                           seed=1)),
        ("a blue square", P(image=picture(2), mask_image=m, strength=0.8, num_inference_steps=6, guidance_scale=4.0,
                            seed=2, aesthetic_score=8.5, negative_aesthetic_score=1.0, negative_prompt="blurry")),
        ("a green star", P(image=picture(3), mask_image=m, strength=0.7, num_inference_steps=6, guidance_scale=1.0,
                           seed=3, aesthetic_score=3.0)),
        ("two", P(image=picture(4), mask_image=m, strength=0.9, num_inference_steps=5, guidance_scale=3.0, seed=4,
                  sampler="euler_a", n=2, negative_aesthetic_score=4.0)),
    ]
    params = [SamplingParams(**{**p.__dict__, "output_type": "np", **size}) for _, p in jobs]
    outs = engine.generate([prompt for prompt, _ in jobs], params, use_tqdm=False)
    for (prompt, _), p, out in zip(jobs, params, outs):
        assert out.error is None, out.error
        expected = _reference(pipe, engine, prompt, p)
        assert len(out.images) == len(expected) == p.n
        for got, want in zip(out.images, expected):
            assert float(np.abs(got - want).max()) <= 1e-3
    # the scores matter: another negative score changes a CFG request's image
    other = SamplingParams(**{**params[1].__dict__, "negative_aesthetic_score": 9.0})
    changed = engine.generate(["a blue square"], [other], use_tqdm=False)[0].images[0]
    assert float(np.abs(changed - outs[1].images[0]).max()) > 1e-3


def test_scores_are_refused_where_they_mean_nothing(refiner_path, sdxl_path):
    refiner = DiffusionEngine(model=refiner_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="image: this model conditions on an aesthetic score"):
        refiner.add_request("t2i", "x", SamplingParams())  # diffusers has no text-to-image for such a UNet
    with pytest.raises(ValueError, match="aesthetic_score must be a finite number"):
        refiner.add_request("nan", "x", SamplingParams(image=picture(1), aesthetic_score=float("nan")))
    base = DiffusionEngine(model=sdxl_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="negative_aesthetic_score: this model takes no aesthetic score"):
        base.add_request("base", "x", SamplingParams(image=picture(1), negative_aesthetic_score=2.0))
