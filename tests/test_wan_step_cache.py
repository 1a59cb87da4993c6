"""Step caching on Wan videos: a cached video's latents and cached-step count equal WanPipeline's with
`transformer.enable_cache(<same config>)`, alone and beside uncached videos of other sizes and frame counts.
The pipeline calls cond and uncond apart, so each branch decides for itself, as with Qwen-Image.
diffusers' default TaylorSeer patterns ("^blocks.*attn", matched whole) match none of Wan's attentions (attn1,
attn2): there it would predict nothing. dvllm predicts both attentions of every block, and the reference names
them (cache_identifiers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import _saved, tiny_wan_pipeline
from test_step_cache import EDGE, MAG, Recorder
from test_wan import LATENT_TOL

from dvllm import DiffusionEngine, SamplingParams
from dvllm.step_cache import parse_cache

P = SamplingParams
THRESHOLD = 0.1  # inside the tiny Wan's first-block ratios for this request (the test checks both outcomes)


@pytest.fixture(scope="module")
def wan_cache_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-wan-cache", tiny_wan_pipeline())


def reference(path: str, recorder: Recorder, prompt: str, p: SamplingParams) -> tuple[np.ndarray, int]:
    """The pipeline's latents with the request's cache, and the steps on which both branches skipped."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    config = parse_cache(p.cache).diffusers_config()
    if p.cache["method"] == "taylorseer":
        config.cache_identifiers = [r"^blocks\.\d+\.attn[12]$"]
    pipe.transformer.enable_cache(config)
    recorder.decisions.clear()
    latents = pipe(prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps,
                   height=p.height, width=p.width, num_frames=p.num_frames, guidance_scale=p.guidance_scale,
                   generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent").frames
    calls = recorder.calls()
    per_step = [calls[i:i + 2] for i in range(0, len(calls), 2)]  # cond and uncond
    return latents.numpy(), sum(all(step) for step in per_step)


@pytest.mark.parametrize("method", ["first_block", "taylorseer", "mag"])
def test_a_cached_video_equals_diffusers_alone_and_beside_others(wan_cache_path, method, monkeypatch):
    cache = {"first_block": {"method": "first_block", "threshold": THRESHOLD}, "mag": MAG,
             "taylorseer": {"method": "taylorseer", "cache_interval": 3, "disable_cache_before_step": 2,
                            "max_order": 1}}[method]
    prompt = "a red circle moving to the right"
    params = P(num_inference_steps=10, guidance_scale=4.0, seed=11, height=32, width=32, num_frames=9,
               output_type="latent", cache=cache)
    recorder = Recorder(monkeypatch)
    want, skipped = reference(wan_cache_path, recorder, prompt, params)
    assert 0 < skipped < params.num_inference_steps, f"the test's config must skip some steps, not all: {skipped}"
    edges = [r for r in recorder.ratios if abs(r - THRESHOLD) < EDGE] if method == "first_block" else []
    assert not edges, f"a first-block decision sat on the threshold's edge ({edges})"

    engine = DiffusionEngine(model=wan_cache_path, device="cpu", dtype="float32")
    others = [("a blue square", P(num_inference_steps=7, guidance_scale=2.0, seed=2, height=16, width=32,
                                  num_frames=5, output_type="latent")),
              ("a green star", P(num_inference_steps=6, guidance_scale=3.0, seed=3, height=32, width=32,
                                 num_frames=9, output_type="latent"))]
    alone = engine.generate(prompt, params, use_tqdm=False)[0]
    outs = engine.generate([prompt] + [q for q, _ in others], [params] + [p for _, p in others], use_tqdm=False)
    for what, out in (("alone", alone), ("beside others", outs[0])):
        assert out.error is None, out.error
        diff = float(np.abs(out.images[0].numpy() - want[0]).max())
        assert diff <= LATENT_TOL, f"{method} {what}: max abs diff {diff}"
        assert out.metrics.cached_steps == skipped, what
    assert engine.stats()["cache_skipped_rows"] > 0


def test_two_experts_refuse_caching_naming_both(tmp_path_factory):
    """Refused at start for default_cache, and per request, each message naming step caching and two experts."""
    path = _saved(tmp_path_factory, "tiny-wan-a14b-cache", tiny_wan_pipeline(two_experts=True))
    with pytest.raises(ValueError, match="default_cache: step caching is not served with two experts"):
        DiffusionEngine(model=path, device="cpu", dtype="float32", default_cache={"method": "first_block"})
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="cache: step caching is not served with two experts"):
        engine.add_request("c", "x", P(cache={"method": "first_block"}))
    engine.shutdown()
