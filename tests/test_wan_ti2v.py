"""Wan 2.2 TI2V (expand_timesteps, the 5B's shape: the 2.2 VAE, no image encoder): a request with an image equals
WanImageToVideoPipeline's video and one without equals WanPipeline's on the same checkpoint, mixed in one batch,
frame by frame and latent by latent; the checkpoint as it ships (WanPipeline) animates images too."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import _saved, tiny_wan_ti2v_pipeline
from diffusers import WanImageToVideoPipeline, WanPipeline
from test_wan import LATENT_TOL, assert_batch_equals_pipeline
from test_wan import reference as text_reference
from test_wan_i2v import picture
from test_wan_i2v import reference as image_reference

from dvllm import DiffusionEngine, SamplingParams

P = SamplingParams


def reference(pipes: tuple, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    """WanImageToVideoPipeline's videos for a request with an image, WanPipeline's for one without."""
    image_pipe, text_pipe = pipes
    if p.image is None:
        return text_reference(text_pipe, prompt, p, output_type)
    return image_reference(image_pipe, prompt, p, output_type)


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    path = _saved(tmp_path_factory, "tiny-wan-ti2v-i2v", tiny_wan_ti2v_pipeline())
    image_pipe = WanImageToVideoPipeline.from_pretrained(path)
    image_pipe.set_progress_bar_config(disable=True)
    parts = {k: v for k, v in image_pipe.components.items() if k not in ("image_encoder", "image_processor")}
    text_pipe = WanPipeline(**parts, expand_timesteps=True)
    text_pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    yield engine, (image_pipe, text_pipe)
    engine.shutdown()


def mixed() -> list[tuple[str, SamplingParams]]:
    """Two videos from images (other images, seeds, steps, guidance; one with n=2) and one from text alone, of
    one size and frame count, so that their rows share every forward they can."""
    return [
        ("the circle rolls away", P(image=picture(1, (64, 32)), num_inference_steps=4, guidance_scale=5.0, seed=1,
                                    height=32, width=64, num_frames=5)),
        ("a square spins", P(image=picture(2, (40, 48)), num_inference_steps=3, guidance_scale=1.0, seed=2,
                             height=32, width=64, num_frames=5, n=2)),
        ("a green star", P(num_inference_steps=5, guidance_scale=3.0, seed=3, height=32, width=64, num_frames=5,
                           negative_prompt="blurry")),
    ]


def test_image_and_text_requests_in_one_batch_equal_their_pipelines(ti2v):
    engine, pipes = ti2v
    rows = []
    hook = engine.executor.worker.runner.adapter.pipeline.transformer.register_forward_hook(
        lambda m, args, kwargs, out: rows.append(len(kwargs["hidden_states"])), with_kwargs=True)
    outs = assert_batch_equals_pipeline(engine, pipes, mixed(), reference)
    hook.remove()
    assert max(rows) >= 2 + 2 + 2  # all three requests' rows, CFG included, in one forward
    # the image counts, and so does having one: another image, or none, is another video
    first = P(**{**vars(mixed()[0][1]), "output_type": "latent"})
    for change in ({"image": picture(9, (64, 32))}, {"image": None}):
        other = engine.generate(mixed()[0][0], P(**{**vars(first), **change}), use_tqdm=False)[0]
        assert other.error is None, other.error
        assert float((other.images[0] - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL, change


def test_the_image_is_optional_sets_the_default_size_and_takes_no_strength(ti2v):
    engine, _ = ti2v
    info, config = engine.model_info, engine.config
    assert info.pipeline_class == "WanImageToVideoPipeline" and not info.images.required
    # the default area (480x832) at the image's aspect ratio, in multiples of 32 (the 2.2 VAE's 16 x 2x2 patches)
    wide = P(image=picture(1, (160, 90))).resolve(info, config)
    tall = P(image=picture(1, (90, 160))).resolve(info, config)
    assert (wide.height, wide.width, tall.height, tall.width) == (448, 832, 832, 448) and wide.num_frames == 81
    assert P(num_frames=5, height=32, width=64).resolve(info, config).image is None
    with pytest.raises(ValueError, match="strength"):
        engine.add_request("strength", "x", P(image=picture(1), strength=0.5))


def test_the_default_size_follows_the_defaults_in_force(tmp_path_factory):
    """TI2V-5B's card runs 704x1280 (model_defaults.py): an image request without a size gets that area at its
    aspect ratio, as the card's image-to-video example sizes it, not the pipeline's 480x832."""
    path = _saved(tmp_path_factory, "tiny-wan-ti2v-defaults", tiny_wan_ti2v_pipeline())
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32",
                             default_params={"height": 704, "width": 1280})
    info, config = engine.model_info, engine.config
    wide = P(image=picture(1, (160, 90))).resolve(info, config)
    assert (wide.height, wide.width) == (704, 1248)  # sqrt(704*1280 * 9/16) = 712 and 1266, down to 32s
    assert (P().resolve(info, config).height, P().resolve(info, config).width) == (704, 1280)
    engine.shutdown()


@pytest.mark.slow
def test_the_checkpoint_as_shipped_animates_an_image(tmp_path_factory):
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers names WanPipeline; its card loads the same files as
    WanImageToVideoPipeline for images. Served as it ships, a request with an image equals that pipeline."""
    path = _saved(tmp_path_factory, "tiny-wan-ti2v-shipped", tiny_wan_ti2v_pipeline(as_shipped=True))
    image_pipe = WanImageToVideoPipeline.from_pretrained(path)
    image_pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    assert engine.model_info.pipeline_class == "WanPipeline"
    assert_batch_equals_pipeline(engine, (image_pipe, None), mixed()[:1], reference)
    engine.shutdown()
