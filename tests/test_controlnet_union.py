"""Union controlnets per request, inside one forward, against diffusers' pipelines request by request: SDXL's
ControlNetUnionModel (StableDiffusionXLControlNetUnionPipeline: a request's images and modes on it in one call)
and a union FluxControlNetModel (num_mode; FluxControlNetPipeline's control_mode).

Each batch mixes a request without a control, one mode, two modes on one request (on SDXL one call, the second
with a window that starts mid-way: the call still runs before it, its scale 0, as there), and requests with
other modes, scales and images; on SDXL two union controlnets on one request (MultiControlNetUnionModel), on
Flux a union controlnet beside a plain one (FluxMultiControlNetModel): each request's images equal the pipeline's
with the same seed, and so do its latents. The tiny controlnets have random weights, their zero-initialized
projections too, and are loaded through dvllm's loader from folders; a plain controlnet beside them also checks
that a mode is refused there.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import ControlNetUnionModel, FluxControlNetModel, StableDiffusionXLControlNetUnionPipeline
from diffusers import StableDiffusionXLPipeline
from test_controlnet import control, control_image, tiny_controlnet
from test_controlnet_flux import reference as flux_reference
from test_controlnet_flux import saved_tiny_flux, tiny_flux_controlnet

from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams
from dvllm.controls import Control, parse_controls
from dvllm.entrypoints.generate_output import image_parameters
from dvllm.worker.controlnets import ControlPlanner
from dvllm.worker.flux_controlnet import flux_request_kind
from dvllm.worker.unet_controlnet import unet_request_calls, unet_request_kind

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
MODES = 4  # the tiny SDXL union controlnet's control types


def union(name: str, image, mode: int, scale: float = 1.0, start: float = 0.0, end: float = 1.0) -> dict:
    return {**control(name, image, scale, start, end), "mode": mode}


def tiny_union_controlnet(unet, seed: int) -> ControlNetUnionModel:
    # the UNet's config (from_unet), its mode transformer as wide as the UNet's first block
    config = dict(ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16),
                                                 load_weights_from_unet=False).config)
    config.pop("_use_default_values")  # (or from_config takes those defaults again, over the values below)
    width = unet.config.block_out_channels[0]
    torch.manual_seed(seed)
    net = ControlNetUnionModel.from_config({**config, "num_control_type": MODES, "num_trans_channel": width,
                                            "num_trans_head": 2, "num_proj_channel": width})
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out,
              net.spatial_ch_projs]
    with torch.no_grad():
        for module in zeroed:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


@pytest.fixture(scope="module")
def sdxl(sdxl_path, tmp_path_factory):
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_path)
    pipe.set_progress_bar_config(disable=True)
    folders = {name: tmp_path_factory.mktemp(f"sdxl-{name}") for name in ("union", "other", "edges")}
    tiny_union_controlnet(pipe.unet, 30).save_pretrained(folders["union"])
    tiny_union_controlnet(pipe.unet, 32).save_pretrained(folders["other"])
    tiny_controlnet(pipe.unet, 31).save_pretrained(folders["edges"])
    engine = DiffusionEngine(model=sdxl_path, device="cpu", dtype="float32",
                             controlnets={name: str(folder) for name, folder in folders.items()})
    nets = {name: ControlNetUnionModel.from_pretrained(folders[name]) for name in ("union", "other")}
    yield engine, pipe, nets
    engine.shutdown()


def sdxl_reference(sdxl, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, nets = sdxl
    common = dict(negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps, height=p.height,
                  width=p.width, num_images_per_prompt=p.n, guidance_scale=p.guidance_scale,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    # one ControlNetUnionModel and its lists, or a MultiControlNetUnionModel of several, one control each
    names = [c["name"] for c in p.controls]
    controlnet = nets[names[0]] if len(set(names)) == 1 else [nets[name] for name in names]
    union_pipe = StableDiffusionXLControlNetUnionPipeline(**pipe.components, controlnet=controlnet,
                                                          add_watermarker=False)
    union_pipe.set_progress_bar_config(disable=True)
    field = (lambda key: [c[key] for c in p.controls])
    return union_pipe(prompt, control_image=field("image"), control_mode=field("mode"),
                      controlnet_conditioning_scale=field("scale"), control_guidance_start=field("start"),
                      control_guidance_end=field("end"), **common).images


def sdxl_batch() -> list[tuple[str, SamplingParams]]:
    one, two, three = control_image(1), control_image(2), control_image(3)
    size = dict(height=16, width=16)
    return [
        ("a red circle", P(num_inference_steps=3, guidance_scale=5.0, seed=1, **size)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=5.0, seed=2, controls=[union("union", one, 1)],
                            **size)),
        ("a blue square", P(num_inference_steps=3, guidance_scale=1.0, seed=3,  # no CFG; the same mode
                            controls=[union("union", two, 1, scale=0.5)], **size)),
        ("a green star", P(num_inference_steps=4, guidance_scale=4.0, seed=4, negative_prompt="blurry",
                           controls=[union("union", one, 0, 0.8), union("union", two, 2, 1.2, start=0.5)], **size)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=3.0, seed=5, n=2,  # the same modes and scales
                            controls=[union("union", three, 0, 0.8), union("union", one, 2, 1.2)], **size)),
        ("a yellow moon", P(num_inference_steps=3, guidance_scale=5.0, seed=6,
                            controls=[union("union", three, 3, end=0.5)], **size)),
        ("a purple cube", P(num_inference_steps=3, guidance_scale=5.0, seed=7,  # two union controlnets
                            controls=[union("union", two, 1, 0.9), union("other", one, 3, 0.7, start=0.4)], **size)),
    ]


def flux_batch() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    size = dict(height=32, width=48)
    return [
        ("a red circle", P(num_inference_steps=3, guidance_scale=3.5, seed=1, **size)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=3.5, seed=2, controls=[union("union", one, 0)],
                            **size)),
        ("a blue square", P(num_inference_steps=3, guidance_scale=5.0, seed=3,  # another mode in the same call
                            controls=[union("union", two, 2)], **size)),
        ("a green star", P(num_inference_steps=4, guidance_scale=4.0, seed=4,
                           controls=[union("union", one, 1, 0.8), union("union", two, 2, 1.2, start=0.5)], **size)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=3.0, seed=5, n=2,
                            controls=[union("union", two, 1, start=0.5)], **size)),
        ("a purple cube", P(num_inference_steps=3, guidance_scale=3.5, seed=7,  # beside a plain controlnet
                            controls=[control("edges", two, 0.6), union("union", one, 2, 0.9)], **size)),
    ]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    path, pipe = saved_tiny_flux(tmp_path_factory)
    folders = {"union": tmp_path_factory.mktemp("flux-union"), "edges": tmp_path_factory.mktemp("flux-edges")}
    tiny_flux_controlnet(2, 1, False, 40, num_mode=3).save_pretrained(folders["union"])
    tiny_flux_controlnet(1, 1, False, 41).save_pretrained(folders["edges"])
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32",
                             controlnets={name: str(folder) for name, folder in folders.items()})
    yield engine, pipe, {name: FluxControlNetModel.from_pretrained(folder) for name, folder in folders.items()}
    engine.shutdown()


def test_sdxl_union_requests_equal_the_union_pipeline(sdxl):
    assert_each_request_matches(sdxl[0], sdxl_batch(), lambda prompt, p, kind: sdxl_reference(sdxl, prompt, p, kind))


def test_flux_union_requests_equal_the_controlnet_pipeline_with_control_mode(flux):
    assert_each_request_matches(flux[0], flux_batch(), lambda prompt, p, kind: flux_reference(flux, prompt, p, kind))


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_the_mode_changes_the_image(family, request):
    """The comparisons above could pass with modes ignored if the tiny controlnets' mode inputs did nothing: they
    move the latents more than the comparison's tolerance (far more on SDXL; Flux's mode is one token beside the
    512 of the text in the controlnet's attention, so its part is small)."""
    engine = request.getfixturevalue(family)[0]
    size = dict(height=16, width=16) if family == "sdxl" else dict(height=32, width=48)
    base = dict(num_inference_steps=3, guidance_scale=4.0, seed=9, output_type="latent", **size)
    a, b = engine.generate(["a cat"] * 2, [P(**base, controls=[union("union", control_image(4), mode)])
                                           for mode in (0, 2)], use_tqdm=False)
    least = 0.01 if family == "sdxl" else 5 * LATENT_TOL
    assert np.abs(np.asarray(a.images[0]) - np.asarray(b.images[0])).max() > least


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_bad_modes_are_refused_naming_the_field(family, request):
    engine = request.getfixturevalue(family)[0]
    modes = engine.model_info.control_modes["union"]
    cases = [
        ([{"name": "union", "image": "x"}],
         rf"controls\[0\].mode: controlnet 'union' is a union controlnet; a control on it names its mode, 0 to "
         rf"{modes - 1}"),
        ([{"name": "union", "image": "x", "mode": 1}, {"name": "union", "image": "x", "mode": modes}],
         rf"controls\[1\].mode must be below {modes}, the control modes of 'union', got {modes}"),
        ([{"name": "edges", "image": "x", "mode": 0}],
         r"controls\[0\].mode: controlnet 'edges' is not a union controlnet; it takes no mode"),
        ([{"name": "union", "image": "x", "mode": -1}], r"controls\[0\].mode must be a union controlnet's control"),
        ([{"name": "union", "image": "x", "mode": True}], r"controls\[0\].mode must be a union controlnet's control"),
    ]
    for controls, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", "a cat", P(controls=controls))


def test_the_engine_reports_its_union_controlnets_modes(sdxl, flux):
    from dvllm.entrypoints.api_server import _served_model_facts

    assert sdxl[0].model_info.control_modes == {"union": MODES, "other": MODES}
    assert flux[0].model_info.control_modes == {"union": 3}
    assert _served_model_facts(flux[0])["control_modes"] == {"union": 3}  # /v1/models


def test_a_union_control_beside_an_input_image_is_refused(sdxl):
    p = P(image=control_image(1, (16, 16)), strength=0.5, controls=[union("union", control_image(2), 1)])
    with pytest.raises(ValueError, match="union controlnet's controls .* text-to-image only"):
        sdxl[0].add_request("bad", "a cat", p)


def test_an_sd_engine_refuses_a_union_controlnet_at_start(sd_eps_path, sdxl):
    with pytest.raises(ValueError, match="is a ControlNetUnionModel, which the stable-diffusion family does not"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32",
                        controlnets={"union": sdxl[0].config.controlnets["union"]})


def test_the_png_record_keeps_a_union_controls_mode_as_a_prompts_file_reads_it():
    params = P(height=16, width=16, controls=(Control("union", None, 0.5, mode=2), Control("edges", None)))
    record = image_parameters(params, "m", {"controls": ["a.png", "b.png"]})["controls"]
    assert record == [{"name": "union", "image": "a.png", "scale": 0.5, "start": 0.0, "end": 1.0, "mode": 2},
                      {"name": "edges", "image": "b.png", "scale": 1.0, "start": 0.0, "end": 1.0}]
    assert [c.mode for c in parse_controls(record)] == [2, None]


def _state(value: float, *controls: Control) -> SimpleNamespace:
    """A request at its step 2 of 4, its control inputs made (one image each, filled with `value`)."""
    data = SimpleNamespace(controls=controls, guidance_scale=1.0)
    return SimpleNamespace(data=data, step=2, plan=SimpleNamespace(num_steps=4),
                           control_images=[torch.full((1, 2, 3), value + place) for place in range(len(controls))])


class _Rows:  # one conditional row a request
    def request_rows(self, request: int) -> tuple[list[int], list[int]]:
        return [request], []


def test_rows_of_other_modes_share_a_flux_call_and_an_sdxl_call_takes_its_requests_modes():
    cpu = SimpleNamespace(device=torch.device("cpu"))
    flux_net = SimpleNamespace(config=SimpleNamespace(num_layers=1, num_single_layers=1), input_hint_block=None)
    flux = ControlPlanner({"union": flux_net}, flux_request_kind, row_modes=True)
    (group,) = flux.plan([_state(0, Control("union", None, mode=0)), _state(1, Control("union", None, mode=2))],
                         _Rows(), cpu).groups
    assert group.row_modes.tolist() == [0, 2] and group.inputs[:, 0, 0].tolist() == [0.0, 1.0]

    sdxl_net = SimpleNamespace(config=SimpleNamespace(global_pool_conditions=False))
    sdxl = ControlPlanner({"union": sdxl_net}, unet_request_kind, unet_request_calls)
    two = (Control("union", None, 0.8, mode=0), Control("union", None, 1.2, mode=2))
    late = (two[0], Control("union", None, 1.2, start=0.75, mode=2))  # its second control not yet at step 2 of 4
    groups = sdxl.plan([_state(0, *two), _state(10, *two), _state(20, *late), _state(30, two[1])], _Rows(),
                       cpu).groups
    assert [(g.index.tolist(), g.call.modes, g.call.scales) for g in groups] == [
        ([0, 1], (0, 2), (0.8, 1.2)), ([2], (0, 2), (0.8, 0.0)), ([3], (2,), (1.2,))]
    shared = groups[0]  # one call: each control's images for its rows, in order
    assert shared.inputs[:, 0, 0].tolist() == [0.0, 10.0] and shared.more[0][:, 0, 0].tolist() == [1.0, 11.0]
