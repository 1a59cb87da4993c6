"""Wan image-to-video: each video equals WanImageToVideoPipeline's for the same image, prompt and seed (frames and
latents), alone and batched with other images, sizes and frame counts; with Wan 2.2 A14B's shape (two experts, no
image encoder) too; the image is required, and a size left out follows the image's aspect ratio."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import _saved, tiny_wan_i2v_pipeline
from diffusers import WanImageToVideoPipeline
from PIL import Image
from test_wan import LATENT_TOL, assert_batch_equals_pipeline

from dvllm import DiffusionEngine, SamplingParams

P = SamplingParams


def picture(seed: int, size: tuple[int, int] = (40, 24)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def reference(pipe, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    """The pipeline's n videos. Its image embedding is repeated per prompt, not per video (num_videos_per_prompt
    > 1 fails in diffusers 0.42), so n videos are asked as n copies of the prompt: the same one draw of noise."""
    extra = {} if p.guidance_scale_2 is None else {"guidance_scale_2": p.guidance_scale_2}
    negative = None if p.negative_prompt is None else [p.negative_prompt] * p.n
    videos = pipe(image=p.image, prompt=[prompt] * p.n, negative_prompt=negative,
                  num_inference_steps=p.num_inference_steps, height=p.height, width=p.width, num_frames=p.num_frames,
                  guidance_scale=p.guidance_scale, output_type=output_type,
                  generator=torch.Generator("cpu").manual_seed(p.seed), **extra).frames
    return videos.numpy() if output_type == "latent" else videos


def batch() -> list[tuple[str, SamplingParams]]:
    return [
        ("the circle rolls away", P(image=picture(1), num_inference_steps=4, guidance_scale=5.0, seed=1, height=16,
                                    width=16, num_frames=5)),
        ("a square spins", P(image=picture(2, (32, 32)), num_inference_steps=3, guidance_scale=1.0, seed=2,
                             height=32, width=16, num_frames=9)),
        ("the star fades", P(image=picture(3, (24, 40)), num_inference_steps=5, guidance_scale=3.0, seed=3,
                             height=16, width=16, num_frames=5, negative_prompt="blurry", n=2)),
    ]


@pytest.mark.parametrize("shape", ["wan2.1-i2v", "wan2.2-i2v-a14b"])
@pytest.mark.slow
def test_videos_from_images_equal_the_pipeline_alone_and_batched(tmp_path_factory, shape):
    two = shape == "wan2.2-i2v-a14b"
    path = _saved(tmp_path_factory, shape, tiny_wan_i2v_pipeline(two_experts=two, image_encoder=not two))
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    requests = batch()
    if two:
        requests[0] = (requests[0][0], P(**{**vars(requests[0][1]), "guidance_scale_2": 2.0}))
    outs = assert_batch_equals_pipeline(engine, pipe, requests, reference)
    alone = engine.generate(requests[0][0], P(**{**vars(requests[0][1]), "output_type": "latent"}), use_tqdm=False)[0]
    np.testing.assert_allclose(alone.images[0].numpy(), outs[0].images[0].numpy(), atol=LATENT_TOL, rtol=0)
    # the image counts: another image, same prompt and seed, is another video
    other = P(**{**vars(requests[0][1]), "image": picture(9), "output_type": "latent"})
    changed = engine.generate(requests[0][0], other, use_tqdm=False)[0].images[0]
    assert float((changed - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL
    engine.shutdown()


def test_the_image_is_required_and_sets_the_default_size(tmp_path_factory):
    path = _saved(tmp_path_factory, "wan-i2v-rules", tiny_wan_i2v_pipeline())
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="animates an image: send an image"):
        engine.add_request("no-image", "x", P())
    with pytest.raises(ValueError, match="strength"):
        engine.add_request("strength", "x", P(image=picture(1), strength=0.5))
    info, config = engine.model_info, engine.config
    wide = P(image=picture(1, (160, 90))).resolve(info, config)
    tall = P(image=picture(1, (90, 160))).resolve(info, config)
    assert (wide.height, wide.width) == (464, 832) and (tall.height, tall.width) == (832, 464)
    assert wide.num_frames == 81 and wide.height * wide.width <= 480 * 832


def test_a_text_to_video_model_refuses_an_image(wan_path):
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="image"):
        engine.add_request("i2v", "x", P(image=picture(1), num_frames=5, height=16, width=16))


@pytest.mark.slow
def test_the_stateful_vae_is_called_by_one_thread_at_a_time(tmp_path_factory):
    """Wan's VAE keeps causal features in the module and every encode or decode resets them: the encode stage's
    image encodes and the decode stage's decodes ran at once and swapped batches (a video of n=5 came back
    with 2 frames' worth of rows, found by the combination matrix). Every VAE call holds the adapter's lock,
    and videos of different n through both stages equal the plain engine's."""
    path = _saved(tmp_path_factory, "wan-i2v-stages", tiny_wan_i2v_pipeline())
    requests = [("the circle rolls away", P(image=picture(1), num_inference_steps=2, guidance_scale=5.0, seed=1,
                                            height=16, width=16, num_frames=5, n=3, output_type="np")),
                ("a square spins", P(image=picture(2), num_inference_steps=3, guidance_scale=1.0, seed=2,
                                     height=16, width=16, num_frames=5, n=1, output_type="np")),
                ("the star fades", P(image=picture(3), num_inference_steps=2, guidance_scale=1.0, seed=3,
                                     height=16, width=16, num_frames=5, n=2, output_type="np"))]
    plain = DiffusionEngine(model=path, device="cpu", dtype="float32")
    want = [o.images for o in plain.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)]
    plain.shutdown()
    staged = DiffusionEngine(model=path, device="cpu", dtype="float32", encode_stage=True, decode_stage=True)
    adapter = staged.executor.worker.runner.adapter
    vae, unlocked = adapter.pipeline.vae, []
    clear_cache = vae.clear_cache

    def checked_clear_cache():  # the first thing of every encode and decode
        if not adapter.vae_lock.locked():
            unlocked.append(threading.current_thread().name)
        clear_cache()

    vae.clear_cache = checked_clear_cache
    for _ in range(2):
        outs = staged.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        for out, expected in zip(outs, want):
            assert len(out.images) == len(expected), out.request_id
            for got, image in zip(out.images, expected):
                np.testing.assert_allclose(np.asarray(got), np.asarray(image), atol=1e-5, rtol=0)
    assert unlocked == []
    staged.shutdown()
