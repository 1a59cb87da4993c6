"""ControlNet per request on Qwen-Image, inside one forward, against QwenImageControlNetPipeline request by request.

One batch mixes rows without a control, with one controlnet at two scales and different images, with two images
of one controlnet on one request (QwenImageMultiControlNetModel: it takes one controlnet), and with a window that
starts mid-way on a request of two images; some requests run true CFG (a negative prompt), whose negative pass
takes the same samples as the prompt's: each request's images equal QwenImageControlNetPipeline's
(QwenImagePipeline's without a control) with the same seed, and so do its latents. That also checks the draws:
each control image's VAE sample, then the start noise, from the request's generator. The tiny transformer has four
blocks; "edges" has one (its sample spans them all), "union" two (each spans two). Their zero-initialized
projections are random, or every sample would be zero; they are loaded through dvllm's loader from folders.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import (
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageMultiControlNetModel,
    QwenImagePipeline,
)
from test_controlnet import control, control_image

from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.qwen_controlnet import QwenControlSamples

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
SIZE = dict(height=16, width=24)  # 2x3 tokens (the tiny VAE scales by 4)
NETS = {"edges": (1, 20), "union": (2, 21)}  # name: blocks, seed


def tiny_qwen_controlnet(num_layers: int, seed: int) -> QwenImageControlNetModel:
    torch.manual_seed(seed)
    net = QwenImageControlNetModel(patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                   axes_dims_rope=(8, 4, 4))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in [*net.controlnet_blocks, net.controlnet_x_embedder]:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from conftest import tiny_qwen_image_pipeline

    path = tmp_path_factory.mktemp("qwen-image-4")
    tiny_qwen_image_pipeline(num_layers=4).save_pretrained(path)
    pipe = QwenImagePipeline.from_pretrained(path)  # as saved (the byte tokenizer comes back as the engine reads it)
    pipe.set_progress_bar_config(disable=True)
    nets = {}
    for name, spec in NETS.items():
        folder = tmp_path_factory.mktemp(f"qwen-controlnet-{name}")
        tiny_qwen_controlnet(*spec).save_pretrained(folder)
        nets[name] = str(folder)
    engine = DiffusionEngine(model=str(path), device="cpu", dtype="float32", controlnets=nets)
    loaded = {name: QwenImageControlNetModel.from_pretrained(folder) for name, folder in nets.items()}
    yield engine, pipe, loaded
    engine.shutdown()


def reference(qwen, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, nets = qwen
    cfg = 4.0 if p.guidance_scale is None else p.guidance_scale  # (the model's default: no negative prompt, unused)
    common = dict(negative_prompt=p.negative_prompt, true_cfg_scale=cfg,
                  num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                  num_images_per_prompt=p.n, generator=torch.Generator("cpu").manual_seed(p.seed),
                  output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    controls = p.controls
    single = len(controls) == 1  # one QwenImageControlNetModel, else a multi-controlnet of the one they name
    controlnet = nets[controls[0]["name"]] if single else QwenImageMultiControlNetModel([nets[controls[0]["name"]]])
    control_pipe = QwenImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    control_pipe.set_progress_bar_config(disable=True)
    field = (lambda key: controls[0][key]) if single else (lambda key: [c[key] for c in controls])
    return control_pipe(prompt, control_image=field("image"), controlnet_conditioning_scale=field("scale"),
                        control_guidance_start=field("start"), control_guidance_end=field("end"), **common).images


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    return [
        ("a red circle", P(num_inference_steps=4, guidance_scale=4.0, seed=1, negative_prompt="blurry", **SIZE)),
        ("a blue square", P(num_inference_steps=3, seed=2, controls=[control("edges", one)], **SIZE)),
        ("a blue square", P(num_inference_steps=3, guidance_scale=3.0, seed=3, negative_prompt="dark",
                            controls=[control("edges", two, scale=0.5)], **SIZE)),
        ("a green star", P(num_inference_steps=4, guidance_scale=4.0, seed=4, negative_prompt="a long negative text",
                           controls=[control("union", one, 0.8), control("union", two, 1.2, end=0.6)], **SIZE)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=2.5, seed=5, n=2, negative_prompt="noise",
                            controls=[control("union", one, start=0.5)], **SIZE)),
        ("a yellow moon", P(num_inference_steps=3, seed=6, controls=[control("union", two, 0.7)], **SIZE)),
    ]


def test_a_mixed_batch_equals_the_qwen_controlnet_pipelines(qwen):
    engine = qwen[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(qwen, prompt, p, output_type))


def test_a_control_changes_the_image_and_its_draw_comes_first(qwen):
    """The comparison above could pass with controls ignored if the tiny controlnets did nothing, or with the
    VAE sample drawn after the noise if it changed nothing: neither holds."""
    engine = qwen[0]
    base = dict(num_inference_steps=4, seed=9, negative_prompt="blurry", output_type="latent", **SIZE)
    plain, controlled, zero = engine.generate(["a cat"] * 3, [
        P(**base), P(**base, controls=[control("edges", control_image(3))]),
        P(**base, controls=[control("edges", control_image(3), scale=0.0)])], use_tqdm=False)
    assert np.abs(np.asarray(plain.images[0]) - np.asarray(controlled.images[0])).max() > 0.05
    # scale 0 adds zeros, but the control's VAE sample still came first: the start noise is not plain's
    assert np.abs(np.asarray(plain.images[0]) - np.asarray(zero.images[0])).max() > 0.05


def test_two_controlnets_on_one_request_are_refused_naming_the_control(qwen):
    one = control_image(1)
    with pytest.raises(ValueError, match=r"controls\[1\]\.name: the qwen-image family takes one controlnet"):
        qwen[0].add_request("r", "a cat", P(controls=[control("union", one), control("edges", one)], **SIZE))


def test_an_inpainting_controlnet_is_refused_at_start():
    net = SimpleNamespace(config=SimpleNamespace(extra_condition_channels=4))
    with pytest.raises(ValueError, match="controlnets: fill is an inpainting controlnet"):
        QwenControlSamples(torch.nn.Linear(1, 1), ForwardHooks(), {"fill": net})
