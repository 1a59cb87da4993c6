"""ControlNet per request on Z-Image, inside one forward, against ZImageControlNetPipeline request by request.

One batch mixes rows without a control and with two controlnets at different scales and images, with and without
CFG (the pipeline's controlnet runs on its CFG batch, each row with its own text), one request of two images, and
one with two controls (the pipeline takes one: of one controlnet and image, their sum is the pipeline's at the
summed scale): each request's images equal ZImageControlNetPipeline's (ZImagePipeline's without a control) with the
same seed, and so do its latents. A request with a LoRA adapter too equals the pipeline with it loaded: the
controlnet runs the transformer's own refiners, and their LoRA layers apply to that request's rows alone. The tiny transformer has two layers; "edges" adds to its first (and refines its control input with
plain transformer blocks), "union" to both (its control input has more channels than the latents: zero-padded;
its refiner adds hints to the controlnet's own noise refiner). Their zero-initialized projections are random, or
every sample would be zero; they are loaded through dvllm's loader from folders.
"""
import numpy as np
import pytest
import torch
from diffusers import ZImageControlNetModel, ZImageControlNetPipeline, ZImagePipeline
from lora_utils import make_lora
from test_controlnet import control, control_image

from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
SIZE = dict(height=16, width=24)  # 4x6 tokens (the tiny VAE scales by 2), padded to 32
NETS = {"edges": dict(control_layers_places=[0], control_in_dim=4, seed=20),
        "union": dict(control_layers_places=[0, 1], control_refiner_layers_places=[0], control_in_dim=8,
                      add_control_noise_refiner="control_noise_refiner", seed=21)}


def tiny_z_image_controlnet(seed: int, **config) -> ZImageControlNetModel:
    torch.manual_seed(seed)
    net = ZImageControlNetModel(all_patch_size=(2,), all_f_patch_size=(1,), dim=32, n_refiner_layers=1, n_heads=2,
                                n_kv_heads=2, **config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "before_proj" in name or "after_proj" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


@pytest.fixture(scope="module")
def z_image(z_image_path, tmp_path_factory):
    pipe = ZImagePipeline.from_pretrained(z_image_path)
    pipe.set_progress_bar_config(disable=True)
    adapters = {"style": make_lora(pipe, str(tmp_path_factory.mktemp("z-image-lora")), seed=11)}
    for name, folder in adapters.items():
        pipe.load_lora_weights(folder, adapter_name=name)
    nets = {}
    for name, config in NETS.items():
        folder = tmp_path_factory.mktemp(f"z-image-controlnet-{name}")
        tiny_z_image_controlnet(**config).save_pretrained(folder)
        nets[name] = str(folder)
    engine = DiffusionEngine(model=z_image_path, device="cpu", dtype="float32", controlnets=nets,
                             lora_modules=adapters)
    loaded = {name: ZImageControlNetModel.from_pretrained(folder) for name, folder in nets.items()}
    yield engine, pipe, loaded
    engine.shutdown()


def reference(z_image, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, nets = z_image
    if p.loras:  # (the controlnet runs the transformer's refiners: their LoRA layers too)
        pipe.enable_lora()
        pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
    else:
        pipe.disable_lora()
    common = dict(negative_prompt=p.negative_prompt, guidance_scale=p.guidance_scale,
                  num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                  num_images_per_prompt=p.n, generator=torch.Generator("cpu").manual_seed(p.seed),
                  output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    # The pipeline takes one control; a request's several are summed, which for one controlnet and image is the
    # pipeline's at the summed scale where the samples are linear in it (a controlnet whose refiner adds scaled
    # hints to its own stream, as "union", is not)
    c = p.controls[0]
    assert all(other["name"] == c["name"] and other["image"] is c["image"] for other in p.controls)
    control_pipe = ZImageControlNetPipeline(**pipe.components, controlnet=nets[c["name"]])
    control_pipe.set_progress_bar_config(disable=True)
    return control_pipe(prompt, control_image=c["image"], controlnet_conditioning_scale=sum(
        other["scale"] for other in p.controls), **common).images


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    return [
        ("a red circle", P(num_inference_steps=3, guidance_scale=4.0, seed=1, negative_prompt="blurry", **SIZE)),
        ("a blue square", P(num_inference_steps=3, guidance_scale=0.0, seed=2, controls=[control("edges", one)],
                            **SIZE)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=3.0, seed=3, negative_prompt="a dark room",
                            controls=[control("edges", two, scale=0.5)], **SIZE)),
        ("a green star", P(num_inference_steps=3, guidance_scale=2.0, seed=4, negative_prompt="flat",
                           controls=[control("edges", two, 0.4), control("edges", two, 0.8)], **SIZE)),
        # beside "two triangles" in one group: the refiners' LoRA layers apply to its rows of the group alone
        ("a lit house", P(num_inference_steps=3, guidance_scale=2.0, seed=7, negative_prompt="dim",
                          loras={"style": 0.8}, controls=[control("union", one, 0.9)], **SIZE)),
        ("two triangles", P(num_inference_steps=3, guidance_scale=2.5, seed=5, n=2, negative_prompt="noise",
                            controls=[control("union", one, 0.9)], **SIZE)),
        ("a yellow moon", P(num_inference_steps=4, guidance_scale=0.0, seed=6, controls=[control("union", two, 1.2)],
                            **SIZE)),
    ]


def test_a_mixed_batch_equals_the_z_image_controlnet_pipelines(z_image):
    engine = z_image[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(z_image, prompt, p, output_type))


def test_a_control_changes_the_image(z_image):
    """The comparison above could pass with controls ignored if the tiny controlnets did nothing."""
    base = dict(num_inference_steps=3, guidance_scale=2.0, seed=9, negative_prompt="blurry", output_type="latent",
                **SIZE)
    plain, controlled = z_image[0].generate(["a cat"] * 2, [
        P(**base), P(**base, controls=[control("union", control_image(3))])], use_tqdm=False)
    assert np.abs(np.asarray(plain.images[0]) - np.asarray(controlled.images[0])).max() > 0.05
