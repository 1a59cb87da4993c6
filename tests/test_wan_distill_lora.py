"""A step-distill LoRA mixed with undistilled requests of the same Wan base, in one batch.

LightX2V's 4-step LoRAs (Wan2.1 "lightx2v" / CausVid, Wan2.2-Lightning, Wan2.2-Distill-Loras) ship in the
original Wan checkpoint's key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.alpha`), which
diffusers' Wan loader converts; a distilled request runs a few steps at guidance 1.0 (no CFG rows) beside
undistilled ones at many steps with CFG. Each video must equal WanPipeline's run alone with the same seed,
steps, guidance and adapter weight (set_adapters), as frames and as latents."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import tiny_wan_pipeline
from diffusers import WanPipeline
from safetensors.torch import save_file
from test_wan import LATENT_TOL, assert_batch_equals_pipeline, pipe_of
from test_wan import reference as wan_reference

from dvllm import DiffusionEngine, SamplingParams

P = SamplingParams
NAME = "lightning"
COMMON = dict(height=16, width=16, num_frames=5)
# Each request starts in the first step: A and C join B's forwards for their own steps (C's at half weight).
BATCH = [("a red circle moving to the right", P(num_inference_steps=4, guidance_scale=1.0, seed=1,
                                                loras={NAME: 1.0}, **COMMON)),
         ("a blue square", P(num_inference_steps=8, guidance_scale=5.0, seed=2, **COMMON)),
         ("a green star", P(num_inference_steps=2, guidance_scale=1.0, seed=3, loras={NAME: 0.5}, **COMMON))]


def lightx2v_style_lora(pipe: WanPipeline, path: str, seed: int, rank: int = 4, alpha: float = 8.0,
                        std: float = 0.2) -> str:
    """A random adapter for every attention and FFN Linear of `pipe`'s transformer blocks, written as LightX2V
    writes its distill LoRAs: the original Wan module names under `diffusion_model.`, lora_down / lora_up with an
    `.alpha` per layer."""
    generator = torch.Generator().manual_seed(seed)
    original = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
                "ffn.net.2": "ffn.2"}
    tensors = {}
    for i, block in enumerate(pipe.transformer.blocks):
        for ours, theirs in original.items():
            layer = block.get_submodule(ours)
            key = f"diffusion_model.blocks.{i}.{theirs}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=generator) * std
            tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=generator) * std
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path)
    return path


@pytest.fixture(scope="module")
def distill(tmp_path_factory):
    """The tiny Wan base with a distill-style LoRA loaded, and the diffusers pipeline with the same adapter."""
    folder = tmp_path_factory.mktemp("wan-distill")
    tiny_wan_pipeline().save_pretrained(folder / "wan")
    pipe = WanPipeline.from_pretrained(folder / "wan")  # loaded: in eval mode, as the engine's (no dropout)
    pipe.set_progress_bar_config(disable=True)
    lora = lightx2v_style_lora(pipe, str(folder / "lora" / "wan_t2v_lightx2v_4step.safetensors"), seed=7)
    engine = DiffusionEngine(model=str(folder / "wan"), device="cpu", dtype="float32", lora_modules={NAME: lora})
    pipe.load_lora_weights(lora, adapter_name=NAME)
    yield engine, pipe
    engine.shutdown()


def reference(pipe: WanPipeline, prompt: str, p: SamplingParams, output_type: str = "np") -> np.ndarray:
    """WanPipeline alone: the adapter at the request's weight (set_adapters), or LoRA off without one."""
    if p.loras:
        pipe.enable_lora()
        pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
    else:
        pipe.disable_lora()
    return wan_reference(pipe, prompt, p, output_type)


def test_distilled_and_undistilled_requests_share_forwards_and_each_equals_the_pipeline(distill):
    engine, pipe = distill
    rows_per_call = []
    hook = pipe_of(engine).transformer.register_forward_hook(
        lambda m, args, kwargs, out: rows_per_call.append(len(kwargs["hidden_states"])), with_kwargs=True)
    try:
        outs = assert_batch_equals_pipeline(engine, pipe, BATCH, reference_of=reference)
    finally:
        hook.remove()
    # Twice (frames, then latents): 8 forwards each, the longest request's steps. A's 4 and C's 2 steps ride
    # along: 1 + 2 + 1 rows while all run, 2 (B's CFG pair) once A finished, no CFG rows for A and C.
    assert rows_per_call == 2 * ([4, 4, 3, 3] + [2] * 4), rows_per_call
    # The checks can fail: the adapter moves A's latents far past their tolerance, and half its weight is
    # another video than its full weight.
    prompt, a = BATCH[0]
    for change in ({"loras": None}, {"loras": {NAME: 0.5}}):
        other = reference(pipe, prompt, P(**{**vars(a), **change}), "latent")[0]
        assert float(np.abs(outs[0].images[0].numpy() - other).max()) > 20 * LATENT_TOL, change


def test_a_distilled_request_alone_equals_itself_in_the_mix(distill):
    """Batching changes nothing: the 2-step half-weight request run alone gives the video it gave beside others."""
    engine, pipe = distill
    prompt, c = BATCH[2]
    params = P(**{**vars(c), "output_type": "latent"})
    alone = engine.generate(prompt, params, use_tqdm=False)[0]
    assert alone.error is None, alone.error
    want = reference(pipe, prompt, params, "latent")[0]
    assert float(np.abs(alone.images[0].numpy() - want).max()) <= LATENT_TOL
