"""ControlNet beside input images, against diffusers' ControlNet image-to-image and inpainting pipelines request by
request: SD and SDXL image-to-image, SD inpainting with a regular (4-channel) UNet, and with an inpainting
(9-channel) UNet, whose controlnet reads the latents alone. Each engine's batch mixes controlled and plain
requests with and without the input image, other strengths and a window that starts mid-way (a fraction of the steps strength leaves, as diffusers counts
it)."""
import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    DiffusionPipeline,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline,
)
from test_controlnet import control, control_image, tiny_controlnet
from test_inpaint import mask, picture, sd_inpaint_path

from conftest import tiny_sd_pipeline
from dvllm import DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
IMPORTED_FIXTURES = (sd_inpaint_path,)  # (imported for pytest to find it)
P = SamplingParams
SIZE = dict(height=24, width=32)
# fixture -> the ControlNet pipeline of its requests with an input image (all of one kind per fixture)
PIPELINES = {
    "sd_eps_path": StableDiffusionControlNetImg2ImgPipeline,
    "sdxl_path": StableDiffusionXLControlNetImg2ImgPipeline,
    "sd_inpaint_path": StableDiffusionControlNetInpaintPipeline,
}


@pytest.fixture(scope="module", params=[*PIPELINES, "sd_eps_path-inpaint"])
def case(request, tmp_path_factory):
    fixture, _, inpaint = request.param.partition("-")
    path = request.getfixturevalue(fixture)
    control_class = StableDiffusionControlNetInpaintPipeline if inpaint else PIPELINES[fixture]
    components = DiffusionPipeline.from_pretrained(path).components
    # a 9-channel UNet's controlnet reads 4 channels: made from the regular UNet of the same config
    unet = tiny_sd_pipeline().unet if fixture == "sd_inpaint_path" else components["unet"]
    folder = tmp_path_factory.mktemp(f"{request.param}-controlnet")
    tiny_controlnet(unet, 10).save_pretrained(folder)
    extra = {"add_watermarker": False} if control_class is StableDiffusionXLControlNetImg2ImgPipeline else {}
    pipe = control_class(**components, controlnet=ControlNetModel.from_pretrained(folder), **extra)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", controlnets={"edges": str(folder)})
    yield engine, pipe, bool(inpaint) or fixture == "sd_inpaint_path", fixture == "sd_inpaint_path"
    engine.shutdown()


def reference(pipe, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    c = p.controls[0]
    extra = {} if p.mask_image is None else {"mask_image": p.mask_image}
    return pipe(prompt, image=p.image, control_image=c["image"], strength=p.strength,
                controlnet_conditioning_scale=c["scale"], control_guidance_start=c["start"],
                control_guidance_end=c["end"], negative_prompt=p.negative_prompt,
                num_inference_steps=p.num_inference_steps, height=p.height, width=p.width, num_images_per_prompt=p.n,
                guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type=output_type, **extra).images


def batch(inpaint: bool) -> list[tuple[str, SamplingParams]]:
    inputs = (lambda seed: {"image": picture(seed), "mask_image": mask()}) if inpaint else \
        (lambda seed: {"image": picture(seed)})
    return [
        ("a red circle", P(num_inference_steps=6, guidance_scale=5.0, seed=1, strength=0.7,
                           controls=[control("edges", control_image(1))], **inputs(1), **SIZE)),
        ("a blue square", P(num_inference_steps=5, guidance_scale=1.0, seed=2, strength=0.9,
                            controls=[control("edges", control_image(2), scale=0.5, start=0.5)], **inputs(2), **SIZE)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=4.0, seed=3, n=2, strength=1.0 if inpaint else 0.8,
                            negative_prompt="blurry", controls=[control("edges", control_image(3), scale=1.3)],
                            **inputs(3), **SIZE)),
    ]


def test_controls_beside_input_images_equal_the_controlnet_pipelines(case):
    engine, pipe, inpaint, inpainting_unet = case
    requests = batch(inpaint)
    # (an inpainting UNet takes no request without a mask)
    plain = [] if inpainting_unet else \
        [("a plain house", P(num_inference_steps=5, guidance_scale=5.0, seed=9, output_type="np", **SIZE))]
    for output_type, tol in (("np", TOL), ("latent", LATENT_TOL)):
        params = [P(**{**vars(p), "output_type": output_type}) for _, p in requests]
        outs = engine.generate([q for q, _ in requests + plain], params + [p for _, p in plain], use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        for (prompt, p), out in zip(requests, outs):
            want = np.asarray(reference(pipe, prompt, p, output_type))
            got = np.stack([np.asarray(image) for image in out.images])
            assert got.shape == want.shape
            diff = float(np.abs(got - want).max())
            assert diff <= tol, f"{prompt!r} {output_type}: max abs diff {diff}"
