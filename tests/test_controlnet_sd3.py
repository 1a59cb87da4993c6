"""ControlNet per request on SD3, against StableDiffusion3ControlNetPipeline request by request.

One batch mixes rows without a control, with one controlnet at two scales and different images, with two
controlnets on one request (SD3MultiControlNetModel, of different depths: their samples sum to the fewer), and a
window that starts mid-way with n=2, with and without CFG. The pipeline draws its control images' VAE samples from
torch's global RNG (dvllm: from a generator of the request's own); the test's VAE has a latent distribution of
near-zero width (its log-variance at the clamp's -30: a standard deviation of 3e-7), so both draws give the same
latents to far below the tolerance, and everything else is compared as it is.
"""
import numpy as np
import pytest
import torch
from diffusers import (
    SD3ControlNetModel,
    SD3MultiControlNetModel,
    StableDiffusion3ControlNetPipeline,
    StableDiffusion3Pipeline,
)
from test_controlnet import control, control_image

from conftest import tiny_sd3_pipeline
from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
SIZE = dict(height=16, width=16)


def tiny_sd3_controlnet(num_layers: int, force_zeros: bool, seed: int) -> SD3ControlNetModel:
    torch.manual_seed(seed)
    net = SD3ControlNetModel(sample_size=8, patch_size=1, in_channels=4, num_layers=num_layers, attention_head_dim=8,
                             num_attention_heads=4, joint_attention_dim=48, caption_projection_dim=32,
                             pooled_projection_dim=48, out_channels=4, force_zeros_for_pooled_projection=force_zeros)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # its zero-initialized input embedding and output blocks, or every sample would be zero
        for module in [net.pos_embed_input, *net.controlnet_blocks]:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    pipe = tiny_sd3_pipeline()
    conv = pipe.vae.encoder.conv_out  # [mean, log-variance] channels: the log-variance pinned at the clamp
    with torch.no_grad():
        half = conv.out_channels // 2
        conv.weight[half:] = 0.0
        conv.bias[half:] = -1e4
    folder = tmp_path_factory.mktemp("tiny-sd3-narrow-vae")
    pipe.save_pretrained(folder)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)  # (as saved: the tokenizers as they load)
    pipe.set_progress_bar_config(disable=True)
    nets = {"edges": tiny_sd3_controlnet(1, True, 10), "depth": tiny_sd3_controlnet(2, False, 11)}
    paths = {}
    for name, net in nets.items():
        paths[name] = str(tmp_path_factory.mktemp(f"sd3-controlnet-{name}"))
        net.save_pretrained(paths[name])
    engine = DiffusionEngine(model=str(folder), device="cpu", dtype="float32", controlnets=paths)
    yield engine, pipe, {name: SD3ControlNetModel.from_pretrained(path) for name, path in paths.items()}
    engine.shutdown()


def reference(sd3, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, nets = sd3
    common = dict(negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps, height=p.height,
                  width=p.width, num_images_per_prompt=p.n, guidance_scale=p.guidance_scale,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    controls = p.controls
    single = len(controls) == 1
    controlnet = nets[controls[0]["name"]] if single else SD3MultiControlNetModel([nets[c["name"]] for c in controls])
    control_pipe = StableDiffusion3ControlNetPipeline(**pipe.components, controlnet=controlnet)
    control_pipe.set_progress_bar_config(disable=True)
    field = (lambda key: controls[0][key]) if single else (lambda key: [c[key] for c in controls])
    return control_pipe(prompt, control_image=field("image"), controlnet_conditioning_scale=field("scale"),
                        control_guidance_start=field("start"), control_guidance_end=field("end"), **common).images


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    return [
        ("a red circle", P(num_inference_steps=4, guidance_scale=5.0, seed=1, **SIZE)),
        ("a blue square", P(num_inference_steps=5, guidance_scale=5.0, seed=2, controls=[control("edges", one)],
                            **SIZE)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=1.0, seed=3,
                            controls=[control("edges", two, scale=0.5)], **SIZE)),
        ("a green star", P(num_inference_steps=4, guidance_scale=4.0, seed=4, negative_prompt="blurry",
                           controls=[control("depth", one, 0.8), control("edges", two, 1.2)], **SIZE)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=3.0, seed=5, n=2,
                            controls=[control("depth", two, start=0.5)], **SIZE)),
    ]


def test_a_mixed_batch_equals_the_sd3_controlnet_pipelines(sd3):
    engine = sd3[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(sd3, prompt, p, output_type))
    plain = engine.generate(["a blue square"], [P(**{**vars(batch[1][1]), "controls": None, "output_type": "np"})],
                            use_tqdm=False)[0]
    controlled = engine.generate(["a blue square"], [P(**{**vars(batch[1][1]), "output_type": "np"})],
                                 use_tqdm=False)[0]
    assert float(np.abs(plain.images[0] - controlled.images[0]).max()) > 1e-2  # the control acts
