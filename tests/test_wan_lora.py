"""Wan LoRAs through diffusers' loader: each video's latents equal WanPipeline's with the request's adapters set
(load_lora_weights, set_adapters), alone and in a batch where rows carry no adapter, one, or two with weights."""
from __future__ import annotations

import numpy as np
import torch
from conftest import tiny_wan_pipeline
from diffusers import WanPipeline
from lora_utils import make_lora
from test_wan import LATENT_TOL

from dvllm import DiffusionEngine, SamplingParams

P = SamplingParams


def test_wan_videos_with_loras_equal_the_pipeline_alone_and_mixed(tmp_path):
    pipe = tiny_wan_pipeline()
    pipe.save_pretrained(tmp_path / "wan")
    adapters = {"motion": make_lora(pipe, str(tmp_path / "motion"), seed=1),
                "style": make_lora(pipe, str(tmp_path / "style"), seed=2, rank=2)}
    engine = DiffusionEngine(model=str(tmp_path / "wan"), device="cpu", dtype="float32", lora_modules=adapters)
    base = dict(num_inference_steps=4, guidance_scale=4.0, height=16, width=16, num_frames=5, output_type="latent")
    batch = [("a red circle", P(**base, seed=1)),
             ("a red circle", P(**base, seed=1, loras={"motion": 1.0})),
             ("a blue square", P(**{**base, "num_frames": 9}, seed=2, loras={"motion": 0.6, "style": 0.8})),
             ("a green star", P(**{**base, "guidance_scale": 1.0}, seed=3, loras={"style": 1.2}))]
    alone = engine.generate(batch[2][0], batch[2][1], use_tqdm=False)[0]
    outs = engine.generate([q for q, _ in batch], [p for _, p in batch], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    pipe = WanPipeline.from_pretrained(tmp_path / "wan")  # loaded: in eval mode, as the engine's (no dropout)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name)
    for i, ((prompt, p), out) in enumerate(zip(batch, outs)):
        want = reference(pipe, prompt, p)
        diff = float(np.abs(out.images[0].numpy() - want).max())
        assert diff <= LATENT_TOL, f"{prompt!r} loras={p.loras}: max abs diff {diff}"
        if i == 2:
            assert float(np.abs(alone.images[0].numpy() - want).max()) <= LATENT_TOL
    change = float((outs[1].images[0] - outs[0].images[0]).abs().max())
    assert change > 20 * LATENT_TOL, f"the adapter changed the latents by only {change}"
    engine.shutdown()


def reference(pipe, prompt: str, p: SamplingParams) -> np.ndarray:
    """WanPipeline's latents for one request, its adapters set as set_adapters sets them (LoRA off without)."""
    if p.loras:
        pipe.enable_lora()
        pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
    else:
        pipe.disable_lora()
    return pipe(prompt, num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                num_frames=p.num_frames, guidance_scale=p.guidance_scale, output_type="latent",
                generator=torch.Generator("cpu").manual_seed(p.seed)).frames[0].numpy()


def test_a_text_to_video_lora_on_image_to_video_equals_the_pipeline(tmp_path):
    """An image-to-video pipeline's loader gives a LoRA without image-attention weights (add_k_proj, add_v_proj)
    zero weights there. No layer takes them where the model has no such modules (this tiny one: no
    added_kv_proj_dim), or where the adapter's saved config names its targets (the real I2V models). They change
    nothing, so dvllm serves the adapter; it used to refuse it, as weights for modules the model lacks."""
    from conftest import tiny_wan_i2v_pipeline
    from diffusers import WanImageToVideoPipeline
    from test_wan_i2v import picture
    from test_wan_i2v import reference as i2v_reference

    pipe = tiny_wan_i2v_pipeline()
    pipe.save_pretrained(tmp_path / "i2v")
    lora = make_lora(pipe, str(tmp_path / "t2v-shaped"), seed=1)  # no image-attention weights
    engine = DiffusionEngine(model=str(tmp_path / "i2v"), device="cpu", dtype="float32",
                             lora_modules={"motion": lora})
    base = dict(image=picture(1), num_inference_steps=3, guidance_scale=5.0, height=16, width=16, num_frames=5,
                seed=1, output_type="latent")
    outs = engine.generate(["the circle rolls away"] * 2, [P(**base), P(**base, loras={"motion": 0.8})],
                           use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path / "i2v")
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora, adapter_name="motion")
    pipe.set_adapters(["motion"], adapter_weights=[0.8])
    want = i2v_reference(pipe, "the circle rolls away", P(**base, loras={"motion": 0.8}), "latent")
    diff = float(np.abs(outs[1].images[0].numpy() - want[0]).max())
    assert diff <= LATENT_TOL, f"max abs diff {diff}"
    assert float((outs[1].images[0] - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL  # the adapter counts
    engine.shutdown()
