"""ControlNet per request on Flux, inside one forward, against FluxControlNetPipeline request by request.

One batch mixes rows without a control, with one controlnet at two scales and different images, with two
controlnets on one request (FluxMultiControlNetModel), and with a window that starts mid-way on a request of two
images: each request's images equal FluxControlNetPipeline's (FluxPipeline's without a control) with the same
seed, and so do its latents. That also checks the draws: each control image's VAE sample, then the start noise,
from the request's generator. The tiny transformer has four double and two single blocks (and a VAE that scales by
8, as XLabs' hint block does); "edges" has one of each (its samples span several blocks), "depth" two double blocks
and no single ones (on one request with "edges" the lists sum as the multi-controlnet sums them), "lines" is an
XLabs controlnet (an input_hint_block: the image itself, its two samples repeated over the blocks) in the same
forward. Their zero-initialized projections are random, or every sample would be zero; they are loaded through
dvllm's loader from folders.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FluxControlNetModel, FluxControlNetPipeline, FluxMultiControlNetModel, FluxPipeline
from test_controlnet import control, control_image

from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams
from dvllm.controls import Control
from dvllm.worker.controlnets import ControlPlanner
from dvllm.worker.flux_controlnet import flux_request_kind

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
SIZE = dict(height=32, width=48)  # 2x3 tokens
NETS = {"edges": (1, 1, False, 20), "depth": (2, 0, False, 21), "lines": (2, 1, True, 22)}
#        name: double blocks, single blocks, XLabs (an input_hint_block), seed


def tiny_flux_controlnet(num_layers: int, num_single_layers: int, xlabs: bool, seed: int,
                         num_mode: int | None = None) -> FluxControlNetModel:
    torch.manual_seed(seed)
    # XLabs': the hint block's 8x downsampling, then patches of 2 (4 channels -> the transformer's 16)
    hint = dict(patch_size=2, conditioning_embedding_channels=4) if xlabs else dict(patch_size=1)
    net = FluxControlNetModel(in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                              pooled_projection_dim=24, axes_dims_rope=[4, 4, 8], guidance_embeds=True,
                              num_mode=num_mode, **hint)
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]
    with torch.no_grad():
        for module in zeroed + ([net.input_hint_block.conv_out] if xlabs else []):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


def saved_tiny_flux(tmp_path_factory) -> tuple[str, FluxPipeline]:
    """A tiny Flux of four double and two single blocks, saved; and as loaded back."""
    from conftest import tiny_flux_pipeline

    path = tmp_path_factory.mktemp("flux-4x2")
    torch.manual_seed(3)
    vae = AutoencoderKL(block_out_channels=(8, 8, 8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    FluxPipeline(**{**tiny_flux_pipeline(num_layers=4, num_single_layers=2).components, "vae": vae}).save_pretrained(path)
    pipe = FluxPipeline.from_pretrained(path)  # as saved (the byte tokenizers come back as the engine reads them)
    pipe.set_progress_bar_config(disable=True)
    return str(path), pipe


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    path, pipe = saved_tiny_flux(tmp_path_factory)
    nets = {}
    for name, spec in NETS.items():
        folder = tmp_path_factory.mktemp(f"flux-controlnet-{name}")
        tiny_flux_controlnet(*spec).save_pretrained(folder)
        nets[name] = str(folder)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", controlnets=nets)
    loaded = {name: FluxControlNetModel.from_pretrained(folder) for name, folder in nets.items()}
    yield engine, pipe, loaded
    engine.shutdown()


def reference(flux, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, nets = flux
    common = dict(num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                  num_images_per_prompt=p.n, guidance_scale=p.guidance_scale,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    controls = p.controls
    single = len(controls) == 1  # one FluxControlNetModel, else a FluxMultiControlNetModel of them in order
    controlnet = nets[controls[0]["name"]] if single else FluxMultiControlNetModel([nets[c["name"]] for c in controls])
    components = {k: v for k, v in pipe.components.items() if k not in ("image_encoder", "feature_extractor")}
    control_pipe = FluxControlNetPipeline(**components, controlnet=controlnet)
    control_pipe.set_progress_bar_config(disable=True)
    field = (lambda key: controls[0][key]) if single else (lambda key: [c[key] for c in controls])
    modes = [c.get("mode") for c in controls]  # a union controlnet's (None: another's, which ignores it)
    modes = {"control_mode": modes[0] if single else modes} if any(m is not None for m in modes) else {}
    return control_pipe(prompt, control_image=field("image"), controlnet_conditioning_scale=field("scale"),
                        control_guidance_start=field("start"), control_guidance_end=field("end"), **modes,
                        **common).images


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    size = SIZE
    return [
        ("a red circle", P(num_inference_steps=4, guidance_scale=3.5, seed=1, **size)),
        ("a blue square", P(num_inference_steps=5, guidance_scale=3.5, seed=2, controls=[control("edges", one)],
                            **size)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=5.0, seed=3,
                            controls=[control("edges", two, scale=0.5)], **size)),
        ("a green star", P(num_inference_steps=5, guidance_scale=4.0, seed=4,
                           controls=[control("edges", one, 0.8), control("depth", two, 1.2)], **size)),
        ("two triangles", P(num_inference_steps=6, guidance_scale=3.0, seed=5, n=2,
                            controls=[control("depth", one, start=0.5)], **size)),
        ("a yellow moon", P(num_inference_steps=4, guidance_scale=3.5, seed=6, controls=[control("lines", two, 0.7)],
                            **size)),
    ]


def test_a_mixed_batch_equals_the_flux_controlnet_pipelines(flux):
    engine = flux[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(flux, prompt, p, output_type))


def test_a_control_changes_the_image_and_its_draw_comes_first(flux):
    """The comparison above could pass with controls ignored if the tiny controlnets did nothing, or with the
    VAE sample drawn after the noise if it changed nothing: neither holds."""
    engine = flux[0]
    base = dict(num_inference_steps=4, guidance_scale=3.5, seed=9, output_type="latent", **SIZE)
    plain, controlled, zero = engine.generate(["a cat"] * 3, [
        P(**base), P(**base, controls=[control("edges", control_image(3))]),
        P(**base, controls=[control("edges", control_image(3), scale=0.0)])], use_tqdm=False)
    assert np.abs(np.asarray(plain.images[0]) - np.asarray(controlled.images[0])).max() > 0.05
    # scale 0 adds zeros, but the control's VAE sample still came first: the start noise is not plain's
    assert np.abs(np.asarray(plain.images[0]) - np.asarray(zero.images[0])).max() > 0.05


def test_without_a_size_a_flux_request_takes_the_models_default(flux):
    engine = flux[0]
    resolved = engine.processor.process("r", "a cat", P(controls=[control("edges", control_image(4))])).params
    info = engine.processor.info
    assert (resolved.height, resolved.width) == (info.defaults.height, info.defaults.width)  # not the image's 26x30


def test_controls_with_step_caching_are_refused_naming_the_pair(flux):
    with pytest.raises(ValueError, match=r"controls: not served with step caching \(cache\)"):
        flux[0].add_request("r", "a cat", P(cache={"method": "teacache", "rel_l1_thresh": 0.4},
                                            controls=[control("edges", control_image(1))]))


def test_kontext_takes_no_controlnet(flux, tmp_path_factory):
    from test_flux_kontext import tiny_flux_kontext_pipeline

    path = tmp_path_factory.mktemp("kontext")
    tiny_flux_kontext_pipeline().save_pretrained(path)
    with pytest.raises(ValueError, match="controlnets: the flux-kontext family takes no ControlNet"):
        DiffusionEngine(model=str(path), device="cpu", dtype="float32", controlnets=flux[0].config.controlnets)


def test_a_groups_inputs_are_concatenated_once_while_its_members_stay():
    net = SimpleNamespace(config=SimpleNamespace(num_layers=1, num_single_layers=1), input_hint_block=None)

    def state(n: int, value: float) -> SimpleNamespace:
        data = SimpleNamespace(controls=(Control("edges", None),), guidance_scale=value)
        return SimpleNamespace(data=data, step=0, plan=SimpleNamespace(num_steps=4),
                               control_images=[torch.full((n, 2, 3), value)])

    class Rows:  # each request's rows, one per image, in order (Flux has no unconditional rows)
        def __init__(self, counts):
            self.bounds = np.cumsum([0, *counts])

        def request_rows(self, request):
            return list(range(self.bounds[request], self.bounds[request + 1])), []

    planner, a, b = ControlPlanner({"edges": net}, flux_request_kind), state(2, 1.0), state(1, 2.0)
    pool = SimpleNamespace(device=torch.device("cpu"))  # (Flux's inputs are the requests' own, not the pool's)
    first = planner.plan([a, b], Rows([2, 1]), pool).groups[0]
    again = planner.plan([a, b], Rows([2, 1]), pool).groups[0]
    assert again.inputs is first.inputs and again.guidance is first.guidance
    assert first.inputs[:, 0, 0].tolist() == [1.0, 1.0, 2.0] and first.guidance.tolist() == [1.0, 1.0, 2.0]
    alone = planner.plan([b], Rows([1]), pool).groups[0]
    assert alone.inputs[:, 0, 0].tolist() == [2.0] and alone.index.tolist() == [0]
