"""TeaCache per request (dvllm/step_caches/teacache.py): each request's images, latents and skipped-step count
equal a reference TeaCache written here as a plain loop (TeaCache4FLUX's rule, one request at a time, over
the diffusers Flux pipeline), alone and inside a mixed batch; bad requests are ValueErrors (HTTP 400) naming
the field.

The reference is its own code: the Flux transformer's forward, rewritten with the TeaCache decision around its
blocks (diffusers has no TeaCache hook). Thresholds: the tiny random-weight transformer's modulated input moves little
from step to step, so each step adds about 0.18 (FLUX's polynomial near 0): thresholds of 0.6 and 0.9 skip
three or four steps between computing ones; each test asserts that skips happen (and computing steps past
the first), and that no accumulated value sat on its threshold's edge.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_step_cache import THRESHOLDS, assert_images_close

from dvllm import DiffusionEngine, SamplingParams
from dvllm.step_caches.registry import served_methods
from dvllm.step_caches.teacache import COEFFICIENTS

P = SamplingParams
EDGE = 1e-4  # an accumulated distance this close to the threshold could round either way
LATENT_TOL = 1e-4


@pytest.fixture(scope="module")
def deep_flux_path(tmp_path_factory) -> str:
    from conftest import tiny_flux_pipeline

    path = tmp_path_factory.mktemp("flux-teacache")
    tiny_flux_pipeline(num_layers=2, num_single_layers=2).save_pretrained(path)
    return str(path)


class ReferenceTeaCache:
    """TeaCache around a Flux transformer's blocks, for one request (one pipeline call) at a time."""

    def __init__(self, transformer, coefficients, threshold: float, num_steps: int) -> None:
        self.t, self.rescale = transformer, np.poly1d(coefficients)
        self.threshold, self.num_steps = threshold, num_steps
        self.step, self.accumulated, self.previous, self.residual = 0, 0.0, None, None
        self.skipped, self.sums = 0, []

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, return_dict=True, **_):
        t = self.t
        hidden = t.x_embedder(hidden_states)
        timestep = timestep.to(hidden.dtype) * 1000
        guidance = None if guidance is None else guidance.to(hidden.dtype) * 1000
        temb = t.time_text_embed(timestep, pooled_projections) if guidance is None \
            else t.time_text_embed(timestep, guidance, pooled_projections)
        encoder = t.context_embedder(encoder_hidden_states)
        rotary = t.pos_embed(torch.cat((txt_ids, img_ids), dim=0))

        modulated = t.transformer_blocks[0].norm1(hidden, emb=temb)[0]
        if self.step in (0, self.num_steps - 1):
            compute, self.accumulated = True, 0.0
        else:
            distance = ((modulated - self.previous).abs().mean() / self.previous.abs().mean()).item()
            self.accumulated += self.rescale(distance)
            self.sums.append(self.accumulated)
            compute = self.accumulated >= self.threshold
            if compute:
                self.accumulated = 0.0
        self.previous = modulated
        self.step += 1

        if compute:
            start = hidden
            for block in [*t.transformer_blocks, *t.single_transformer_blocks]:
                encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                        image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
            self.residual = hidden - start
        else:
            hidden = hidden + self.residual
            self.skipped += 1
        out = t.proj_out(t.norm_out(hidden, temb))
        return (out,) if not return_dict else type("Output", (), {"sample": out})()


def reference(path: str, prompt: str, p: SamplingParams, output_type: str) -> tuple[np.ndarray, ReferenceTeaCache]:
    """The Flux pipeline's images (or latents) for one request, TeaCache around its transformer."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    tea = ReferenceTeaCache(pipe.transformer, p.cache.get("coefficients", COEFFICIENTS["flux"]),
                            p.cache.get("rel_l1_thresh", 0.25), p.num_inference_steps)
    pipe.transformer.forward = tea.forward
    out = pipe(prompt, num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
               num_images_per_prompt=p.n, guidance_scale=p.guidance_scale, output_type=output_type,
               generator=torch.Generator("cpu").manual_seed(p.seed)).images
    return (out.numpy() if torch.is_tensor(out) else out), tea


def tea(threshold: float) -> dict:
    return {"method": "teacache", "rel_l1_thresh": threshold}


def mixed_batch() -> list[tuple[str, SamplingParams]]:
    """TeaCache at two thresholds (one with two images), another method, no cache, other step counts."""
    base = dict(height=32, width=32, output_type="np")
    return [
        ("a red circle", P(num_inference_steps=10, guidance_scale=3.5, seed=11, n=2, cache=tea(0.6), **base)),
        ("a blue square", P(num_inference_steps=7, guidance_scale=2.0, seed=2, cache=tea(0.9), **base)),
        ("a green star", P(num_inference_steps=12, guidance_scale=4.0, seed=3, **base,
                           cache={"method": "first_block", "threshold": THRESHOLDS["flux"]})),
        ("no cache at all", P(num_inference_steps=6, guidance_scale=3.0, seed=4, **base)),
        ("a longer prompt so that the text lengths differ in the forward",
         P(num_inference_steps=9, guidance_scale=5.0, seed=5, cache=tea(0.6), **base)),
    ]


@pytest.mark.slow
def test_teacache_requests_equal_the_reference_alone_and_in_a_mixed_batch(deep_flux_path):
    requests = mixed_batch()
    engine = DiffusionEngine(model=deep_flux_path, device="cpu", dtype="float32")
    outs = engine.generate([q for q, _ in requests], [p for _, p in requests], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    stats = engine.stats()
    assert stats["cache_skipped_rows"] > 0 and stats["cache_computed_rows"] > 0
    for (prompt, p), out in zip(requests, outs):
        if not isinstance(p.cache, dict) or p.cache["method"] != "teacache":
            continue
        want, ref = reference(deep_flux_path, prompt, p, "np")
        edges = [s for s in ref.sums if abs(s - p.cache["rel_l1_thresh"]) < EDGE]
        assert not edges, f"an accumulated distance sat on the threshold's edge ({edges}): choose another"
        assert 0 < ref.skipped < p.num_inference_steps - 2, f"{prompt!r} must skip some steps, not all"
        assert_images_close(out.images, want, f"teacache {prompt!r} in a mixed batch")
        assert out.metrics.cached_steps == ref.skipped, prompt

    prompt, p = requests[0]
    alone = engine.generate(prompt, p, use_tqdm=False)[0]
    assert_images_close(alone.images, outs[0].images, "teacache alone")
    uncached = engine.generate(prompt, dataclasses.replace(p, cache=None), use_tqdm=False)[0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone.images, uncached.images)) > 1e-4, \
        "skipping steps must change the images, or this test proves nothing"


@pytest.mark.slow
def test_teacache_latents_equal_the_reference(deep_flux_path):
    """The latents before the VAE too (packed in patches, as the pipeline returns them)."""
    prompt, p = mixed_batch()[1]
    p = dataclasses.replace(p, output_type="latent")
    engine = DiffusionEngine(model=deep_flux_path, device="cpu", dtype="float32")
    out = engine.generate(prompt, p, use_tqdm=False)[0]
    want, ref = reference(deep_flux_path, prompt, p, "latent")
    got = np.stack([np.asarray(image) for image in out.images])
    assert got.shape == want.shape, (got.shape, want.shape)
    assert float(np.abs(got - want).max()) <= LATENT_TOL
    assert out.metrics.cached_steps == ref.skipped > 0


def test_teacache_is_a_flux_method_in_the_capability_table(flux_path, sd3_path):
    flux = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    assert "teacache" in served_methods(flux.processor.info)
    resolved = flux.processor.process("a", "x", P(height=32, width=32, cache=tea(0.4))).params.cache
    assert resolved.coefficients == COEFFICIENTS["flux"]  # the model's, as the request left them out
    own = flux.processor.process("b", "x", P(height=32, width=32, cache={**tea(0.4), "coefficients": [1, 0]}))
    assert own.params.cache.coefficients == (1.0, 0.0)
    sd3 = DiffusionEngine(model=sd3_path, device="cpu", dtype="float32")
    assert "teacache" not in served_methods(sd3.processor.info) and "first_block" in served_methods(sd3.processor.info)
    with pytest.raises(ValueError, match="cache.method: teacache is not served for the stable-diffusion-3 family"):
        sd3.add_request("r", "x", P(cache=tea(0.4)))
    with pytest.raises(ValueError, match="default_cache: cache.method: teacache is not served"):
        DiffusionEngine(model=sd3_path, device="cpu", dtype="float32", default_cache="teacache")


@pytest.mark.parametrize("cache, message", [
    ({"method": "teacache", "rel_l1_tresh": 0.3}, "cache.rel_l1_tresh is not a field of teacache"),
    ({"method": "teacache", "rel_l1_thresh": -0.1}, "cache.rel_l1_thresh must be a finite number >= 0"),
    ({"method": "teacache", "rel_l1_thresh": "high"}, "cache.rel_l1_thresh must be a finite number >= 0"),
    ({"method": "teacache", "rel_l1_thresh": float("nan")}, "cache.rel_l1_thresh must be a finite number >= 0"),
    ({"method": "teacache", "coefficients": []}, "cache.coefficients must be a list of 1 to 10"),
    ({"method": "teacache", "coefficients": [1, "x"]}, "cache.coefficients must be a list of 1 to 10"),
    ({"method": "teacache", "coefficients": 3}, "cache.coefficients must be a list of 1 to 10"),
    ({"method": "teacache", "coefficients": [1.0] * 11}, "cache.coefficients must be a list of 1 to 10"),
])
def test_bad_teacache_configs_are_value_errors_naming_the_field(cache, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(cache=cache).validate()


def test_a_bad_teacache_request_is_a_400_naming_the_field(flux_path):
    import argparse

    from fastapi.testclient import TestClient

    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.entrypoints.api_server import build_app

    engine = AsyncDiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    with TestClient(build_app(engine, argparse.Namespace(served_model_name="tiny"))) as client:
        response = client.post("/v1/images/generations", json={
            "prompt": "x", "size": "16x16", "num_inference_steps": 2,
            "cache": {"method": "teacache", "rel_l1_thresh": "x"}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache" and "cache.rel_l1_thresh" in error["message"], error


def test_the_benchmark_baseline_says_diffusers_has_no_teacache():
    """The cached benchmark's diffusers baseline skips TeaCache with a reason, instead of failing on it."""
    from dvllm.benchmarks.baselines.pipeline_options import diffusers_cache_unsupported
    from dvllm.step_cache import parse_cache

    why = diffusers_cache_unsupported(torch.nn.Linear(1, 1), parse_cache(tea(0.4)))
    assert why is not None and "diffusers has no teacache cache" in why
