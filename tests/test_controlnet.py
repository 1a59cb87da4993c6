"""ControlNet per request inside one forward, against diffusers' ControlNet pipelines request by request.

One batch mixes rows without a control, with one at two scales and different images, with two controlnets
on one request, and with a window that starts mid-way (with and without CFG, n=2): each request's images
equal StableDiffusion[XL]ControlNetPipeline's (StableDiffusion[XL]Pipeline's without a control) with the same
seed, and so do its latents. The tiny controlnets are made from the tests' tiny UNets with random weights (their
zero convolutions too, or every residual would be zero) and loaded through dvllm's loader from folders.
"""
import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLPipeline,
)
from PIL import Image

from request_checks import assert_each_request_matches
from dvllm import AsyncDiffusionEngine, DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
FAMILIES = {  # fixture of the tiny pipeline, its pipeline class, its ControlNet pipeline class
    "sd": ("sd_eps_path", StableDiffusionPipeline, StableDiffusionControlNetPipeline),
    "sdxl": ("sdxl_path", StableDiffusionXLPipeline, StableDiffusionXLControlNetPipeline),
}


def tiny_controlnet(unet, seed: int) -> ControlNetModel:
    # the tiny VAEs scale by 2: one downsampling in the conditioning embedding
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16), load_weights_from_unet=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return net


def control_image(seed: int, size: tuple[int, int] = (30, 26)) -> Image.Image:
    """An edge-map-like RGB image of another size than the request's (the pipeline resizes it)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) > 0.7).astype(np.uint8) * 255)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    fixture, pipeline_class, control_class = FAMILIES[request.param]
    path = request.getfixturevalue(fixture)
    pipe = pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    nets = {}
    for name, seed in (("edges", 10), ("depth", 11)):
        folder = tmp_path_factory.mktemp(f"{request.param}-controlnet-{name}")
        tiny_controlnet(pipe.unet, seed).save_pretrained(folder)
        nets[name] = str(folder)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", controlnets=nets)
    loaded = {name: ControlNetModel.from_pretrained(folder) for name, folder in nets.items()}
    yield engine, pipe, control_class, loaded
    engine.shutdown()


def reference(family, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, control_class, nets = family
    common = dict(negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps, height=p.height,
                  width=p.width, num_images_per_prompt=p.n, guidance_scale=p.guidance_scale,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
    if not p.controls:
        return pipe(prompt, **common).images
    controls = p.controls
    single = len(controls) == 1  # one ControlNetModel, else a MultiControlNetModel of them in order
    controlnet = nets[controls[0]["name"]] if single else [nets[c["name"]] for c in controls]
    extra = {"add_watermarker": False} if control_class is StableDiffusionXLControlNetPipeline else {}
    control_pipe = control_class(**pipe.components, controlnet=controlnet, **extra)
    control_pipe.set_progress_bar_config(disable=True)
    field = (lambda key: controls[0][key]) if single else (lambda key: [c[key] for c in controls])
    return control_pipe(prompt, image=field("image"), controlnet_conditioning_scale=field("scale"),
                        control_guidance_start=field("start"), control_guidance_end=field("end"), **common).images


def control(name: str, image: Image.Image, scale: float = 1.0, start: float = 0.0, end: float = 1.0) -> dict:
    return {"name": name, "image": image, "scale": scale, "start": start, "end": end}


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = control_image(1), control_image(2)
    size = dict(height=16, width=16)
    return [
        ("a red circle", P(num_inference_steps=5, guidance_scale=5.0, seed=1, **size)),
        ("a blue square", P(num_inference_steps=6, guidance_scale=5.0, seed=2, controls=[control("edges", one)],
                            **size)),
        ("a blue square", P(num_inference_steps=4, guidance_scale=1.0, seed=3,
                            controls=[control("edges", two, scale=0.5)], **size)),
        ("a green star", P(num_inference_steps=5, guidance_scale=4.0, seed=4, negative_prompt="blurry",
                           controls=[control("edges", one, 0.8), control("depth", two, 1.2)], **size)),
        ("two triangles", P(num_inference_steps=6, guidance_scale=3.0, seed=5, n=2,
                            controls=[control("depth", one, start=0.5)], **size)),
    ]


def test_a_mixed_batch_equals_the_controlnet_pipelines(family):
    engine = family[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(family, prompt, p, output_type))


def test_a_control_changes_the_image_and_its_window_matters(family):
    """The comparison above could pass with controls ignored if the tiny controlnets did nothing: they do not."""
    engine = family[0]
    base = dict(num_inference_steps=4, guidance_scale=5.0, seed=9, height=16, width=16, output_type="np")
    plain, controlled, late = engine.generate(["a cat"] * 3, [
        P(**base), P(**base, controls=[control("edges", control_image(3))]),
        P(**base, controls=[control("edges", control_image(3), start=0.75)])], use_tqdm=False)
    assert np.abs(plain.images[0] - controlled.images[0]).max() > 0.05
    assert np.abs(controlled.images[0] - late.images[0]).max() > 0.01


def test_without_a_size_the_first_control_image_gives_it(family):
    engine = family[0]
    out = engine.generate("a cat", P(num_inference_steps=2, seed=1, controls=[control("edges", control_image(4,
                                                                                                        (37, 23)))]),
                          use_tqdm=False)[0]
    assert out.images[0].size == (32, 16)  # (width, height) rounded down to the model's size factor, 8


@pytest.mark.parametrize("controls, message", [
    ([{"name": "nope", "image": "x"}], r"controls\[0\].name: no controlnet 'nope' is loaded"),
    ([{"name": "edges", "image": None}], r"controls\[0\].image: a control needs its conditioning image"),
    ([{"name": "edges", "image": "x", "scale": -1}], r"controls\[0\].scale must be in \[0, 100\]"),
    ([{"name": "edges", "image": "x", "start": 0.6, "end": 0.5}], r"controls\[0\]: start and end"),
    ([{"name": "edges", "image": "x", "strength": 1}], r"controls\[0\]: unknown field"),
    ([{"name": "edges", "image": "x"}] * 5, r"controls: at most 4 controls"),
    ("edges", r"controls must be a list"),
])
def test_bad_controls_are_refused_naming_the_field(family, controls, message):
    with pytest.raises(ValueError, match=message):
        family[0].add_request("bad", "a cat", P(controls=controls))


def test_an_engine_without_controlnets_refuses_controls(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    try:
        with pytest.raises(ValueError, match="this engine serves no controlnets"):
            engine.add_request("r", "a cat", P(controls=[control("edges", control_image(1))]))
    finally:
        engine.shutdown()


def test_controls_beside_an_input_image_are_refused_where_the_family_has_no_such_pipeline(family):
    """(SD and SDXL have ControlNet img2img and inpainting pipelines: test_controlnet_inputs.py. A family
    without them refuses the pair per request.)"""
    engine = family[0]
    info = engine.model_info
    info = dataclasses.replace(info, images=dataclasses.replace(info.images, controls=False))
    p = P(image=control_image(1, (16, 16)), strength=0.5, controls=[control("edges", control_image(2))])
    with pytest.raises(ValueError, match="takes controls with text-to-image only, not beside input images"):
        p.resolve(info, engine.config)


def test_controls_through_the_core_process_async_and_both_stages_equal_in_process(family, sd_eps_path):
    """The prepared images travel to the core's process with the request; async scheduling, the encode and the
    decode stage leave the controlled images as the in-process engine makes them."""
    if family[1].__class__ is not StableDiffusionPipeline:
        pytest.skip("one family is enough for the process modes")  # SDXL: the same code path
    engine = family[0]
    nets = engine.config.controlnets
    batch = mixed()[1:4]
    params = [P(**{**vars(p), "output_type": "np"}) for _, p in batch]
    want = engine.generate([q for q, _ in batch], params, use_tqdm=False)

    async def run() -> list:
        other = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=nets,
                                     engine_core_process=True, async_scheduling=True, encode_stage=True,
                                     decode_stage=True)
        other.start()
        try:
            return await asyncio.gather(*(_final(other, q, p, f"r{i}") for i, ((q, _), p) in
                                          enumerate(zip(batch, params))))
        finally:
            await other.shutdown(5)

    got = asyncio.run(run())
    for a, b in zip(got, want):
        assert a.error is None, a.error
        np.testing.assert_allclose(np.stack(a.images), np.stack(b.images), atol=1e-5, rtol=0)


async def _final(engine: AsyncDiffusionEngine, prompt: str, params: SamplingParams, request_id: str):
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
    return final


def test_controlnets_in_a_worker_group_or_on_another_family_are_refused_at_start(sd_eps_path, wan_path, family):
    nets = family[0].config.controlnets
    with pytest.raises(ValueError, match="does not serve .*controlnets"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=nets, cfg_parallel_size=2)
    with pytest.raises(ValueError, match="controlnets: the wan family takes no ControlNet in dvllm yet"):
        DiffusionEngine(model=wan_path, device="cpu", dtype="float32", controlnets=nets)
