"""Qwen-Image-Edit and Qwen-Image-Edit Plus: each request's image equals its diffusers pipeline's for that
request alone, in batches that mix input images of other sizes (other token grids), one and several images,
true CFG and not, and n > 1."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams
from dvllm.models.qwen_image_edit import VAE_AREA, target_size


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).random((size[1], size[0], 3))
    return Image.fromarray((pixels * 255).astype("uint8"))


def reference(pipe, prompt: str, p: SamplingParams) -> np.ndarray:
    return pipe(image=p.image, prompt=prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.guidance_scale,
                num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                num_images_per_prompt=p.n, generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type="np").images


def _check(path: str, jobs: list[tuple[str, SamplingParams]]) -> DiffusionEngine:
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    outs = engine.generate([prompt for prompt, _ in jobs], [p for _, p in jobs], use_tqdm=False)
    for (prompt, p), out in zip(jobs, outs):
        assert out.error is None, out.error
        expected = reference(pipe, prompt, p)
        assert len(out.images) == len(expected) == p.n
        for got, want in zip(out.images, expected):
            assert got.shape == want.shape
            assert float(np.abs(got - want).max()) <= 1e-3, prompt
    return engine


def P(**kwargs) -> SamplingParams:
    return SamplingParams(**{"num_inference_steps": 3, "height": 32, "width": 32, "guidance_scale": 4.0,
                             "output_type": "np", **kwargs})


@pytest.mark.slow
def test_edits_of_other_input_sizes_share_steps_and_match_the_pipeline(qwen_image_edit_path):
    tall, wide = picture(1, (40, 56)), picture(2, (64, 48))
    jobs = [
        ("make it red", P(image=tall, negative_prompt="blurry", n=2, seed=1)),  # true CFG, two images
        ("add a hat", P(image=wide, seed=2)),  # another input size: another token grid
        # the same prompt with another image: its conditions must not come from the prompt cache
        ("add a hat", P(image=tall, seed=3, negative_prompt=" ", guidance_scale=3.0, num_inference_steps=4)),
        ("make it red", P(image=tall, negative_prompt="blurry", seed=4, height=64)),  # another output size
    ]
    engine = _check(qwen_image_edit_path, jobs)
    # identical prompts with identical images share one encoding; with other images they do not
    stats = engine.stats()
    assert stats["prompt_cache_hits"] == 2  # "make it red" and "blurry" with the same image, again


@pytest.mark.slow
def test_plus_takes_one_or_several_images(qwen_image_edit_plus_path):
    jobs = [
        ("combine them", P(image=[picture(1, (40, 40)), picture(2, (64, 32))], seed=1, negative_prompt="ugly")),
        ("one image", P(image=picture(3, (48, 40)), seed=2)),
        ("three", P(image=[picture(4, (32, 32)), picture(5, (40, 32)), picture(6, (32, 48))], seed=3, n=2)),
    ]
    _check(qwen_image_edit_plus_path, jobs)


@pytest.mark.slow
def test_the_real_vaes_scale_matches_the_pipeline(tmp_path):
    """The fixtures' VAE downsamples 16x to keep the suite fast; the real one downsamples 8x (4096 tokens an
    input image, output sizes in multiples of 16): one batch at that scale, two images and one, equals the pipeline."""
    from qwen_edit_utils import tiny_qwen_image_edit_pipeline

    tiny_qwen_image_edit_pipeline(plus=True, vae_scale=8).save_pretrained(tmp_path)
    jobs = [("combine them", P(image=[picture(1, (40, 40)), picture(2, (64, 32))], seed=1, height=48,
                               negative_prompt="ugly", num_inference_steps=2)),
            ("one image", P(image=picture(3, (48, 40)), seed=2, width=16, num_inference_steps=2))]
    _check(str(tmp_path), jobs)


def test_the_default_size_is_the_pipelines(qwen_image_edit_path, qwen_image_edit_plus_path):
    """Without height and width: about 1024x1024 with the (Plus: last) image's aspect, as calculate_dimensions."""
    for path, images in ((qwen_image_edit_path, picture(1, (300, 200))),
                         (qwen_image_edit_plus_path, [picture(1, (300, 200)), picture(2, (100, 300))])):
        engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
        params = SamplingParams(image=images).resolve(engine.model_info, engine.config)
        last = images[-1] if isinstance(images, list) else images
        width, height = target_size(VAE_AREA, last.width, last.height)
        assert (params.height, params.width) == (height // 16 * 16, width // 16 * 16)


@pytest.mark.slow
def test_edit_errors_name_the_field(qwen_image_edit_path, qwen_image_edit_plus_path):
    engine = DiffusionEngine(model=qwen_image_edit_path, device="cpu", dtype="float32")
    image = picture(1, (40, 40))
    bad = [
        (SamplingParams(), "image: this model \\(QwenImageEditPipeline\\) edits images"),
        (SamplingParams(image=image, strength=0.5), "strength: QwenImageEditPipeline conditions on its images"),
        (SamplingParams(image=[image, image]), "image: 2 images, but this model takes at most 1"),
        (SamplingParams(image=image, mask_image=image), "mask_image: inpainting is not supported"),
        (SamplingParams(image=image, height=40), "height must be a positive multiple of 32"),
    ]
    for params, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", "x", params)
    plus = DiffusionEngine(model=qwen_image_edit_plus_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="image: 4 images, but this model takes at most 3"):
        plus.add_request("r", "x", SamplingParams(image=[image] * 4))
    assert not engine.has_unfinished_requests() and not plus.has_unfinished_requests()


@pytest.mark.slow
def test_served_edits_with_several_images_equal_the_engine(qwen_image_edit_plus_path):
    """The openai client's images.edit with two images (sent as image[]), plain and streamed: the engine's pixels."""
    from openai import OpenAI
    from utils_server import BASE_ARGS, RemoteServer, png_pixels

    images = [picture(1, (40, 40)), picture(2, (64, 32))]
    files = []
    for k, image in enumerate(images):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        files.append((f"in{k}.png", buffer.getvalue(), "image/png"))
    body = {"num_inference_steps": 3, "seed": 7, "guidance_scale": 4.0, "negative_prompt": "blurry"}
    engine = DiffusionEngine(model=qwen_image_edit_plus_path, device="cpu", dtype="float32")
    out = engine.generate("put them together", SamplingParams(image=images, height=32, width=32, **body),
                          use_tqdm=False)[0]
    assert out.error is None, out.error
    expected = np.asarray(out.images[0].convert("RGB"))
    with RemoteServer(qwen_image_edit_plus_path, BASE_ARGS) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        result = client.images.edit(image=files, prompt="put them together", size="32x32", extra_body=body)
        np.testing.assert_array_equal(png_pixels(result.data[0].b64_json), expected)
        events = list(client.images.edit(image=files, prompt="put them together", size="32x32", stream=True,
                                         partial_images=1, extra_body=body))
        assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
        np.testing.assert_array_equal(png_pixels(events[-1].b64_json), expected)


@pytest.mark.slow
def test_zero_cond_t_models_run_a_call_per_shape_set(tmp_path):
    """Qwen-Image-Edit-2511's transformer (zero_cond_t) modulates each token by its image's place in the sequence,
    which padding would shift: rows of other input shapes run apart, and still equal the pipeline."""
    from diffusers import QwenImageTransformer2DModel
    from qwen_edit_utils import tiny_qwen_image_edit_pipeline

    pipe = tiny_qwen_image_edit_pipeline()
    torch.manual_seed(3)
    pipe.transformer = QwenImageTransformer2DModel.from_config({**pipe.transformer.config, "zero_cond_t": True})
    pipe.save_pretrained(tmp_path)
    jobs = [("make it red", P(image=picture(1, (40, 56)), negative_prompt="blurry", seed=1)),
            ("add a hat", P(image=picture(2, (64, 48)), seed=2))]
    _check(str(tmp_path), jobs)


@pytest.mark.parametrize("fixture", ["qwen_image_edit_path", "qwen_image_path", "flux_path"])
def test_previews_of_packed_latents(fixture, request):
    """Partial images of the packed-latent families ([rows, tokens, features] latents) decode at the output size."""
    path = request.getfixturevalue(fixture)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    params = SamplingParams(num_inference_steps=3, num_previews=1, height=32, width=32, seed=1)
    if engine.model_info.images.required:
        params.image = picture(1, (40, 40))
    engine.add_request("r", "x", params)
    previews = []
    while engine.has_unfinished_requests():
        previews += [p for out in engine.step() for p in out.previews]
    assert len(previews) == 1 and previews[0].size == (32, 32)


@pytest.mark.slow
def test_lora_rows_in_separate_calls_keep_their_adapters(qwen_image_edit_plus_path, tmp_path):
    """Rows of other image counts run in separate transformer calls within one step: each call's LoRA layers
    must see its own rows' adapters. Every image equals the pipeline with the adapter set as the request asks."""
    from lora_utils import make_lora, reference_images

    pipe = DiffusionPipeline.from_pretrained(qwen_image_edit_plus_path)
    pipe.set_progress_bar_config(disable=True)
    adapter = make_lora(pipe, str(tmp_path / "edit"), seed=3)
    engine = DiffusionEngine(model=qwen_image_edit_plus_path, device="cpu", dtype="float32",
                             lora_modules=[f"edit={adapter}"], max_input_images_per_step=8)
    one, two = [picture(1, (40, 40))], [picture(2, (64, 32)), picture(3, (32, 48))]
    jobs = [("one image", P(image=one, seed=1, loras={"edit": 1.0})),
            ("two images", P(image=two, seed=2)),
            ("two again", P(image=two, seed=3, loras={"edit": 0.5}))]
    adapter_model = engine.executor.worker.runner.adapter
    denoise, rows_per_call = adapter_model.denoise, []

    def counted(latents, *args, **kwargs):
        rows_per_call.append(len(latents))
        return denoise(latents, *args, **kwargs)

    adapter_model.denoise = counted
    outs = engine.generate([prompt for prompt, _ in jobs], [p for _, p in jobs], use_tqdm=False)
    adapter_model.denoise = denoise
    # every step ran the three rows in one forward (a failed batched call would be retried row by row)
    assert rows_per_call == [3] * 3
    for (prompt, p), out in zip(jobs, outs):
        assert out.error is None, out.error
        expected = reference_images(pipe, {"edit": adapter}, p.loras, image=p.image, prompt=prompt,
                                    true_cfg_scale=p.guidance_scale, num_inference_steps=p.num_inference_steps,
                                    height=p.height, width=p.width,
                                    generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np")
        assert float(np.abs(out.images[0] - expected[0]).max()) <= 1e-3, prompt
    # the adapter changes the image (else the comparison above would not test it)
    without = engine.generate(jobs[0][0], P(image=one, seed=1), use_tqdm=False)[0].images[0]
    assert float(np.abs(outs[0].images[0] - without).max()) > 1e-3
    engine.shutdown()


@pytest.mark.slow
def test_the_memory_profile_runs_the_worst_edit_step(qwen_image_edit_plus_path):
    """The GPU pool sizing's worst step (run here with the memory queries faked): a prompt read with as many
    images as the model takes, their encode, and a forward with the largest input state."""
    from dvllm.config import EngineConfig
    from dvllm.worker.memory_profile import step_peaks

    engine = DiffusionEngine(model=qwen_image_edit_plus_path, device="cpu", dtype="float32")
    adapter = engine.executor.worker.runner.adapter

    class Runs:
        def measure(self, run) -> int:
            run()
            return 1

    peaks = step_peaks(adapter, EngineConfig(max_batch_size=2, max_image_pixels=64 * 64), Runs())
    assert set(peaks) == {"encode", "denoise", "decode"}
