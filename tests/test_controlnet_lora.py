"""LoRA and ControlNet on the same requests, inside one batch, against diffusers' StableDiffusionControlNetPipeline
with the adapter loaded (load_lora_weights, set_adapters; LoRA off for a request without it).

One batch holds a request with a LoRA and a control, one with the LoRA only and one with the control only; each
request's images equal the pipeline's with the same seed, and so do its latents. The adapter changes the UNet and
the text encoder, so the controlnet also reads the adapted prompt embeddings, as in diffusers; the controlnet
itself takes no LoRA (the pipeline's loader adapts the UNet and the text encoder only).
"""
import numpy as np
import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline

from dvllm import DiffusionEngine, SamplingParams
from lora_utils import allow_peft_for_transformers, make_lora
from test_controlnet import LATENT_TOL, TOL, control, control_image, tiny_controlnet

P = SamplingParams


@pytest.fixture(scope="module")
def setup(sd_eps_path, tmp_path_factory):
    pipe = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    pipe.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp("controlnet-lora")
    net_folder = str(folder / "edges")
    tiny_controlnet(pipe.unet, seed=10).save_pretrained(net_folder)
    lora = make_lora(pipe, str(folder / "style"), seed=21, components=("unet", "text_encoder"))
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules={"style": lora},
                             controlnets={"edges": net_folder})
    yield engine, pipe, ControlNetModel.from_pretrained(net_folder), lora
    engine.shutdown()


def batch() -> list[tuple[str, SamplingParams]]:
    base = dict(num_inference_steps=5, guidance_scale=5.0, height=16, width=16)
    edges = [control("edges", control_image(1), scale=0.8)]
    return [
        ("a red circle", P(**base, seed=1, loras={"style": 0.7}, controls=edges)),
        ("a red circle", P(**base, seed=1, loras={"style": 0.7})),
        ("a red circle", P(**base, seed=1, controls=edges)),
    ]


def reference(setup, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, pipe, net, lora = setup
    if "style" not in pipe.get_list_adapters().get("unet", []):
        pipe.load_lora_weights(lora, adapter_name="style")
    if p.loras:
        pipe.enable_lora()
        pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
    else:
        pipe.disable_lora()
    call = dict(prompt=prompt, num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type=output_type)
    if not p.controls:
        return pipe(**call).images
    (c,) = p.controls  # the control pipeline shares the adapted UNet and text encoder
    control_pipe = StableDiffusionControlNetPipeline(**pipe.components, controlnet=net)
    control_pipe.set_progress_bar_config(disable=True)
    return control_pipe(**call, image=c["image"], controlnet_conditioning_scale=c["scale"],
                        control_guidance_start=c["start"], control_guidance_end=c["end"]).images


def test_lora_and_control_in_one_batch_equal_the_controlnet_pipeline_with_the_adapter(setup, monkeypatch):
    allow_peft_for_transformers(monkeypatch)
    engine = setup[0]
    requests = batch()
    results = {}
    for output_type, tol in (("np", TOL), ("latent", LATENT_TOL)):
        params = [P(**{**vars(p), "output_type": output_type}) for _, p in requests]
        outs = engine.generate([q for q, _ in requests], params, use_tqdm=False)
        for (prompt, p), out in zip(requests, outs):
            assert out.error is None, out.error
            got = np.stack([np.asarray(image) for image in out.images])
            want = np.asarray(reference(setup, prompt, p, output_type))
            assert got.shape == want.shape
            diff = float(np.abs(got - want).max())
            assert diff <= tol, f"loras={p.loras} controls={bool(p.controls)} {output_type}: max abs diff {diff}"
        results[output_type] = [np.stack([np.asarray(i) for i in o.images]) for o in outs]
    both, lora_only, control_only = results["np"]
    # each of the two changes the image where the other is on: neither is dropped when both are
    assert np.abs(both - lora_only).max() > 0.05 and np.abs(both - control_only).max() > 0.05
