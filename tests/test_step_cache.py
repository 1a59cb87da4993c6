"""Step caching inside step batching: each request's cached image and cached-step count equal the diffusers
pipeline's with `transformer.enable_cache(<same config>)`, alone and inside mixed batches; SD3 (no
enable_cache in diffusers) equals itself alone and batched; a preempted cached request comes back unchanged.

Thresholds: the tiny random-weight transformers' first-block residual moves by a ratio of about 0.15-0.45
from step to step (recorded by the reference run), so thresholds inside that range make some steps skip
and others compute; each test asserts that both happen, and that no decision sat on the threshold's edge.
MagCache decides from its calibrated ratios alone (MAG_RATIOS below, made up for 10 steps), so its skips
do not depend on the weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers.hooks import first_block_cache, mag_cache, taylorseer_cache

from dvllm import DiffusionEngine, SamplingParams
from dvllm.step_cache import parse_cache

TOL = 1e-3
MAG_RATIOS = [1.0, 1.02, 1.01, 0.99, 1.0, 1.0, 1.01, 0.98, 1.0, 1.0]
MAG = {"method": "mag", "mag_ratios": MAG_RATIOS, "num_inference_steps": 10, "threshold": 0.04}
EDGE = 1e-4  # a first-block ratio this close to the threshold could round either way: reported, not compared
P = SamplingParams


def _saved(tmp_path_factory, name, pipe) -> str:
    path = tmp_path_factory.mktemp(name)
    pipe.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def deep_flux_path(tmp_path_factory) -> str:
    from conftest import tiny_flux_pipeline

    return _saved(tmp_path_factory, "flux-deep", tiny_flux_pipeline(num_layers=2, num_single_layers=2))


@pytest.fixture(scope="module")
def deep_qwen_path(tmp_path_factory) -> str:
    from conftest import tiny_qwen_image_pipeline

    return _saved(tmp_path_factory, "qwen-deep", tiny_qwen_image_pipeline(num_layers=4))


class Recorder:
    """Records the decisions diffusers' hooks take (per hook: each transformer call) and the first-block ratios."""

    def __init__(self, monkeypatch) -> None:
        self.decisions: list[tuple[int, bool]] = []  # (hook, skipped or predicted)
        self.ratios: list[float] = []
        fbc_decide = first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks
        taylor_decide = taylorseer_cache.TaylorSeerCacheHook._measure_should_compute
        recorder = self

        def fbc(hook, residual):
            previous = hook.state_manager.get_state().head_block_residual
            if previous is not None:
                recorder.ratios.append(((residual - previous).abs().mean() / previous.abs().mean()).item())
            compute = fbc_decide(hook, residual)
            recorder.decisions.append((id(hook), not compute))
            return compute

        def taylor(hook):
            compute, state = taylor_decide(hook)
            recorder.decisions.append((id(hook), not compute))
            return compute, state

        def mag(hook, state):  # the tail hook ends every call, skipped or not
            recorder.decisions.append((id(hook), not state.should_compute))
            return mag_advance(hook, state)

        mag_advance = mag_cache.MagCacheBlockHook._advance_step
        monkeypatch.setattr(first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks", fbc)
        monkeypatch.setattr(taylorseer_cache.TaylorSeerCacheHook, "_measure_should_compute", taylor)
        monkeypatch.setattr(mag_cache.MagCacheBlockHook, "_advance_step", mag)

    def calls(self) -> list[bool]:
        """One decision per transformer call: those of the first hook that decided (every hook decides alike)."""
        if not self.decisions:
            return []
        first = self.decisions[0][0]
        return [skipped for hook, skipped in self.decisions if hook == first]


def reference(pipe, recorder: Recorder, prompt: str, p: SamplingParams, branches: int) -> tuple[np.ndarray, int]:
    """The pipeline's images with the request's cache, and how many steps every branch skipped."""
    pipe.transformer._reset_stateful_cache()
    recorder.decisions.clear()
    guidance = {"true_cfg_scale": p.guidance_scale} if type(pipe).__name__ == "QwenImagePipeline" \
        else {"guidance_scale": p.guidance_scale}
    images = pipe(prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps,
                  height=p.height, width=p.width, num_images_per_prompt=p.n, output_type="np",
                  generator=torch.Generator("cpu").manual_seed(p.seed), **guidance).images
    calls = recorder.calls()
    per_step = [calls[i:i + branches] for i in range(0, len(calls), branches)]
    return images, sum(all(step) for step in per_step)


def cached_pipeline(path: str, pipeline_class: str, cache: dict):
    import diffusers

    pipe = getattr(diffusers, pipeline_class).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(parse_cache(cache).diffusers_config())
    return pipe


def assert_images_close(got: list, want, what: str) -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        diff = float(np.abs(a - b).max())
        assert diff <= TOL, f"{what}: max abs diff {diff}"


FAMILIES = {"flux": ("deep_flux_path", "FluxPipeline"), "qwen-image": ("deep_qwen_path", "QwenImagePipeline")}
# per family: a first_block threshold inside its ratios' range (see the module's docstring)
THRESHOLDS = {"flux": 0.21, "qwen-image": 0.33}


def request_under_test(family: str, method: str) -> tuple[str, SamplingParams]:
    cache = {"first_block": {"method": "first_block", "threshold": THRESHOLDS[family]}, "mag": MAG,
             "taylorseer": {"method": "taylorseer", "cache_interval": 3, "disable_cache_before_step": 2,
                            "max_order": 1}}[method]
    negative = {"negative_prompt": "blurry and dull"} if family == "qwen-image" else {}  # true CFG: two branches
    return "a red circle", P(num_inference_steps=10, guidance_scale=3.5, seed=11, height=32, width=32, n=2,
                             output_type="np", cache=cache, **negative)


def neighbours(family: str) -> list[tuple[str, SamplingParams]]:
    """Other thresholds, the other method, no cache, other steps, guidance, sizes and n."""
    return [
        ("a blue square", P(num_inference_steps=7, guidance_scale=2.0, seed=2, height=32, width=32, output_type="np")),
        ("a green star", P(num_inference_steps=12, guidance_scale=4.0, seed=3, height=32, width=32, output_type="np",
                           cache={"method": "first_block", "threshold": 0.5}, negative_prompt="x")),
        ("a much longer prompt so that the text lengths differ in the forward", P(
            num_inference_steps=9, guidance_scale=5.0, seed=4, height=32, width=32, output_type="np",
            cache={"method": "taylorseer", "taylor_factors_dtype": "float32"})),
        ("a small one", P(num_inference_steps=8, guidance_scale=3.0, seed=5, height=16, width=16, output_type="np",
                          cache={"method": "first_block", "threshold": 0.05})),
        ("two of them", P(num_inference_steps=6, guidance_scale=3.0, seed=6, height=32, width=32, n=2,
                          output_type="np", cache={"method": "first_block", "threshold": 0.3})),
        ("second order", P(num_inference_steps=9, guidance_scale=3.0, seed=8, height=32, width=32, output_type="np",
                           cache={"method": "taylorseer", "max_order": 2, "cache_interval": 2,
                                  "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"})),
        ("flux's own ratios", P(num_inference_steps=8, guidance_scale=3.0, seed=7, height=32, width=32,
                                output_type="np", cache={"method": "mag", "mag_ratios": "flux",
                                                         "num_inference_steps": 8, "threshold": 0.1})),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["first_block", "taylorseer", "mag"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_request_equals_diffusers_alone_and_in_a_mixed_batch(family, method, request, monkeypatch):
    fixture, pipeline_class = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    prompt, params = request_under_test(family, method)
    recorder = Recorder(monkeypatch)
    pipe = cached_pipeline(path, pipeline_class, params.cache)
    branches = 2 if params.negative_prompt else 1
    want, skipped = reference(pipe, recorder, prompt, params, branches)
    assert 0 < skipped < params.num_inference_steps, f"the test's config must skip some steps, not all: {skipped}"
    edges = [r for r in recorder.ratios if abs(r - params.cache.get("threshold", -1)) < EDGE] \
        if method == "first_block" else []
    assert not edges, f"a first-block decision sat on the threshold's edge ({edges}): choose another threshold"

    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    alone = engine.generate(prompt, params, use_tqdm=False)[0]
    assert alone.error is None, alone.error
    assert_images_close(alone.images, want, f"{family} {method} alone")
    assert alone.metrics.cached_steps == skipped

    others = neighbours(family)
    outs = engine.generate([prompt] + [q for q, _ in others], [params] + [p for _, p in others], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert_images_close(outs[0].images, want, f"{family} {method} in a mixed batch")
    assert outs[0].metrics.cached_steps == skipped
    stats = engine.stats()
    assert stats["cache_skipped_rows"] > 0 and stats["cache_computed_rows"] > 0

    # every neighbour with a cache equals its own diffusers run too
    for (q, p), out in zip(others, outs[1:]):
        if not isinstance(p.cache, dict):
            continue
        ref_pipe = cached_pipeline(path, pipeline_class, p.cache)
        expected, count = reference(ref_pipe, recorder, q, p, 2 if p.negative_prompt and family == "qwen-image" else 1)
        assert_images_close(out.images, expected, f"{family} neighbour {q!r} {p.cache}")
        assert out.metrics.cached_steps == count, (q, p.cache)


OWN_RULE = {"sd3": ("sd3_path", 0.25, 16), "z-image": ("z_image_path", 0.7, 32)}  # fixture, threshold, size


@pytest.mark.slow
@pytest.mark.parametrize("method", ["first_block", "taylorseer", "mag"])
@pytest.mark.parametrize("family", sorted(OWN_RULE))
def test_own_rule_cached_request_alone_equals_it_batched(family, method, request):
    """SD3's and Z-Image's transformers have no enable_cache: dvllm's rule, applied to their blocks, never
    depends on the batch (Z-Image's rows even have sequences of different lengths)."""
    fixture, threshold, size = OWN_RULE[family]
    cache = {"first_block": {"method": "first_block", "threshold": threshold}, "mag": MAG,
             "taylorseer": {"method": "taylorseer"}}[method]
    prompt, params = "a red circle", P(num_inference_steps=10, guidance_scale=3.5, seed=1, height=size, width=size,
                                       n=2, output_type="np", cache=cache)
    engine = DiffusionEngine(model=request.getfixturevalue(fixture), device="cpu", dtype="float32")
    alone = engine.generate(prompt, params, use_tqdm=False)[0]
    uncached = engine.generate(prompt, dataclasses.replace(params, cache=None), use_tqdm=False)[0]
    assert 0 < alone.metrics.cached_steps < params.num_inference_steps
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone.images, uncached.images)) > 1e-4, \
        "caching must change something, or this test proves nothing"
    others = [(q, dataclasses.replace(p, height=size, width=size)) for q, p in neighbours(family)]
    outs = engine.generate([prompt] + [q for q, _ in others], [params] + [p for _, p in others], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert_images_close(outs[0].images, alone.images, f"{family} {method} batched")
    assert outs[0].metrics.cached_steps == alone.metrics.cached_steps


def test_sd3_taylorseer_equals_diffusers_hook_applied_directly(sd3_path):
    """SD3's transformer has no enable_cache, but diffusers' TaylorSeer hook runs on it inside a cache
    context (the cached benchmark's baseline): dvllm's cached SD3, alone and batched, equals it."""
    from diffusers import StableDiffusion3Pipeline

    from dvllm.benchmarks.baselines.pipeline_options import diffusers_cache

    cache = {"method": "taylorseer", "cache_interval": 3, "disable_cache_before_step": 2}
    params = P(num_inference_steps=10, guidance_scale=3.5, seed=5, height=16, width=16, output_type="np", cache=cache)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_path)
    pipe.set_progress_bar_config(disable=True)
    with diffusers_cache(pipe.transformer, parse_cache(cache)):
        want = pipe("a red circle", num_inference_steps=10, guidance_scale=3.5, height=16, width=16,
                    generator=torch.Generator().manual_seed(5), output_type="np").images
    plain = pipe("a red circle", num_inference_steps=10, guidance_scale=3.5, height=16, width=16,
                 generator=torch.Generator().manual_seed(5), output_type="np").images
    assert float(np.abs(want - plain).max()) > 1e-4, "the hook must be on, and off again after"
    engine = DiffusionEngine(model=sd3_path, device="cpu", dtype="float32")
    neighbour = P(num_inference_steps=6, guidance_scale=5.0, seed=9, height=16, width=16, output_type="np")
    outs = engine.generate(["a red circle", "a blue star"], [params, neighbour], use_tqdm=False)
    assert_images_close(outs[0].images, want, "sd3 taylorseer batched")
    assert outs[0].metrics.cached_steps == sum(not parse_cache(cache).computes(i) for i in range(10))


def test_preempted_cached_request_comes_back_with_the_same_image(deep_flux_path):
    """Its cache state is swapped out to host memory with its latents, and back in."""
    cache = {"method": "first_block", "threshold": THRESHOLDS["flux"]}
    low = P(num_inference_steps=10, guidance_scale=3.5, seed=7, height=32, width=32, output_type="np", cache=cache,
            priority=5)
    engine = DiffusionEngine(model=deep_flux_path, device="cpu", dtype="float32", scheduling_policy="priority",
                             max_batch_size=2)
    alone = engine.generate("a red circle", low, use_tqdm=False)[0]
    engine.add_request("low", "a red circle", low)
    finals = {}
    for _ in range(3):
        for out in engine.step():
            finals[out.request_id] = out
    urgent = P(num_inference_steps=4, guidance_scale=3.5, seed=8, height=32, width=32, n=2, output_type="np",
               cache={"method": "taylorseer"}, priority=0)
    engine.add_request("urgent", "a blue square", urgent)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.stats()["num_preemptions"] >= 1, "the urgent request must preempt the cached one"
    assert finals["low"].error is None, finals["low"].error
    assert_images_close(finals["low"].images, alone.images, "cached request after preemption")
    assert finals["low"].metrics.cached_steps == alone.metrics.cached_steps > 0


def test_cache_state_is_counted_in_admission(deep_flux_path):
    """A cached request holds its state's blocks while it runs: more than the same request uncached."""
    engine = DiffusionEngine(model=deep_flux_path, device="cpu", dtype="float32")
    base = P(num_inference_steps=4, height=32, width=32, seed=1)
    plain = engine.processor.process("a", "x", base)
    fbc = engine.processor.process("b", "x", dataclasses.replace(base, cache={"method": "first_block"}))
    taylor = engine.processor.process("c", "x", dataclasses.replace(base, cache={"method": "taylorseer",
                                                                                  "max_order": 2}))
    layout = engine.processor.info.cache_layout
    assert fbc.private_blocks - plain.private_blocks == fbc.cache_blocks > 0
    # first_block: two image-stream residuals per row
    text = layout.text_tokens_for(fbc.params.max_sequence_length, ("x", None))
    assert layout.row_numel(fbc.params.cache, 32, 32, text) == 2 * layout.image_tokens(32, 32) * layout.inner_dim
    assert taylor.cache_blocks > fbc.cache_blocks  # three factors of every attention output
    engine.add_processed(fbc)
    engine.step()
    assert engine.stats()["pool_used_blocks"] >= fbc.private_blocks


@pytest.mark.parametrize("cache, message", [
    ({"method": "fastercache"}, "cache.method must be one of"),
    ({"method": "first_block", "treshold": 0.1}, "cache.treshold is not a field of first_block"),
    ({"method": "first_block", "threshold": "high"}, "cache.threshold must be a finite number"),
    ({"method": "taylorseer", "taylor_factors_dtype": "int8"}, "cache.taylor_factors_dtype must be one of"),
    ({"method": "taylorseer", "cache_interval": 0}, "cache.cache_interval must be an integer"),
    ({"method": "taylorseer", "cache_identifiers": ["x"]}, "cache.cache_identifiers"),
    ("first_block", "cache must be an object"),
    ({"method": "mag"}, "cache.mag_ratios must be a list"),
    ({"method": "mag", "mag_ratios": [1.0, -2.0]}, "cache.mag_ratios must be a list"),
    ({"method": "mag", "mag_ratios": "flux", "calibrate": True}, "cache.calibrate: calibrate with the diffusers"),
    ({"method": "mag", "mag_ratios": "flux", "retention_ratio": 2}, "cache.retention_ratio must be a number"),
])
def test_bad_cache_configs_are_value_errors_naming_the_field(cache, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(cache=cache).validate()


def test_unet_families_refuse_cache_and_default_cache_applies_unless_null(sd_eps_path, flux_path):
    sd = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="cache: the stable-diffusion family serves no step caching"):
        sd.add_request("r", "x", P(cache={"method": "first_block"}))
    with pytest.raises(ValueError, match="default_cache: the stable-diffusion family serves no step caching"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", default_cache="first_block")
    flux = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", default_cache="first_block:threshold=0.2")
    assert flux.processor.process("a", "x", P()).params.cache == parse_cache({"method": "first_block",
                                                                               "threshold": 0.2})
    assert flux.processor.process("b", "x", P(cache=None)).params.cache is None
    own = flux.processor.process("c", "x", P(cache={"method": "taylorseer"})).params.cache
    assert own.method == "taylorseer" and own.taylor_factors_dtype == "bfloat16"
    with pytest.raises(ValueError, match="default_cache|cache.method"):
        DiffusionEngine(model=flux_path, device="cpu", dtype="float32", default_cache="nope:x=1")


def test_qwen_text_state_follows_the_prompts_length_and_is_checked(deep_qwen_path):
    """Qwen-Image's Taylor factors keep as many text tokens as the request's texts can have (byte-level BPE:
    one per byte of the templated text); a row whose text came out longer fails alone, never silently."""
    engine = DiffusionEngine(model=deep_qwen_path, device="cpu", dtype="float32")
    cache = {"method": "taylorseer"}
    short = engine.processor.process("a", "cat", P(height=32, width=32, cache=cache))
    long = engine.processor.process("b", "cat " * 60, P(height=32, width=32, cache=cache))
    assert long.cache_blocks > short.cache_blocks
    adapter = engine.executor.worker.runner.adapter
    adapter.info = dataclasses.replace(adapter.info, cache_layout=dataclasses.replace(
        adapter.info.cache_layout, text_bytes_extra=0))  # the worker now sizes every text too short
    outs = engine.generate(["a red circle", "a blue square"],
                           [P(num_inference_steps=4, height=32, width=32, seed=1, cache=cache),
                            P(num_inference_steps=4, height=32, width=32, seed=2)], use_tqdm=False)
    assert outs[0].error and "more than the" in outs[0].error
    assert outs[1].error is None


def test_a_cache_state_too_big_for_the_pool_is_refused_naming_cache(deep_flux_path):
    """The same request fits without its cache: the refusal says the cache is what does not fit."""
    engine = DiffusionEngine(model=deep_flux_path, device="cpu", dtype="float32", num_state_blocks=20)
    params = P(num_inference_steps=4, height=64, width=64, seed=1, n=2)
    engine.processor.process("plain", "x", params)  # fits
    with pytest.raises(ValueError, match="cache: taylorseer's state for n=2 at 64x64 needs"):
        engine.processor.process("cached", "x", dataclasses.replace(params, cache={"method": "taylorseer"}))
