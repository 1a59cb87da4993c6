"""The exact result cache (result_cache_mb): a seeded request identical to one served is answered from it
without a step; anything that changes the images misses; bounded in bytes; copies in and out."""
from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest
import torch
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.config_flags import add_engine_args, engine_kwargs
from dvllm.engine.result_cache import ResultCache, image_nbytes, result_key

IMAGE_BYTES = 16 * 16 * 3 * 4  # one 16x16 float32 RGB array


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=4, guidance_scale=5.0, height=16, width=16, output_type="np", seed=7)
    return SamplingParams(**{**base, **kwargs})


def make_engine(path: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=path, device="cpu", dtype="float32", state_pool_mb=32, max_image_pixels=64 * 64,
                           max_images_per_prompt=4, **kwargs)


@pytest.fixture(scope="module")
def engine(sd_eps_path) -> DiffusionEngine:
    return make_engine(sd_eps_path, result_cache_mb=1)


@pytest.fixture
def cached(engine) -> DiffusionEngine:
    """The module's engine with an empty cache and counters at 0."""
    engine.result_cache = ResultCache(engine.result_cache.max_bytes)
    return engine


def steps_run(engine: DiffusionEngine) -> int:
    return sum(core.steps for core in engine.coordinator.cores)


def run(engine: DiffusionEngine, request_id: str, prompt: str, params: SamplingParams) -> list:
    """Adds one request and steps until it is done: its final output and every step's output."""
    engine.add_request(request_id, prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    final = [o for o in seen if o.request_id == request_id and o.finished]
    assert len(final) == 1 and final[0].ok, final
    return final[0], seen


# -- the engine ---------------------------------------------------------------------------------------

def test_a_hit_returns_the_first_runs_pixels_without_a_step(cached):
    first, _ = run(cached, "a", "a red square", P())
    assert not first.metrics.result_cache_hit
    assert cached.stats()["result_cache_entries"] == 1 and cached.stats()["result_cache_bytes"] == IMAGE_BYTES
    before = steps_run(cached)
    cached.add_request("b", "a red square", P())
    assert cached.has_unfinished_requests()  # the hit waits in the pending outputs for step()
    outs = cached.step()
    assert steps_run(cached) == before and cached.last_step.num_requests == 0  # no denoiser step ran
    (hit,) = outs
    assert hit.request_id == "b" and hit.ok and hit.metrics.result_cache_hit
    assert hit.num_steps_done == hit.num_inference_steps == first.num_inference_steps and hit.seed == 7
    assert hit.metrics.first_scheduled_time == hit.metrics.finished_time >= hit.metrics.arrival_time
    np.testing.assert_array_equal(hit.images[0], first.images[0])
    assert not cached.has_unfinished_requests()
    stats = cached.stats()
    assert (stats["result_cache_hits"], stats["result_cache_queries"]) == (1, 2)
    # The offline loop hits too.
    (again,) = cached.generate("a red square", P(), use_tqdm=False)
    assert again.metrics.result_cache_hit and steps_run(cached) == before
    np.testing.assert_array_equal(again.images[0], first.images[0])


@pytest.mark.parametrize("change", [
    {"seed": 8}, {"prompt": "a blue square"}, {"guidance_scale": 4.0}, {"negative_prompt": "blurry"},
    {"num_inference_steps": 3}, {"n": 2}, {"output_type": "pil"}, {"sampler": "euler"},
], ids=lambda c: next(iter(c)))
def test_a_changed_field_misses(cached, change):
    change = dict(change)
    run(cached, "first", "a red square", P())
    prompt = change.pop("prompt", "a red square")
    before = steps_run(cached)
    out, _ = run(cached, "second", prompt, P(**change))
    assert not out.metrics.result_cache_hit and steps_run(cached) > before
    assert cached.stats()["result_cache_hits"] == 0 and cached.stats()["result_cache_entries"] == 2


def test_fields_that_leave_the_images_alone_still_hit(cached):
    first, _ = run(cached, "first", "a red square", P())
    for i, change in enumerate([{"priority": 5}, {"output_kind": "final"}, {"num_previews": 2}]):
        out, _ = run(cached, f"again-{i}", "a red square", P(**change))
        assert out.metrics.result_cache_hit, change
        np.testing.assert_array_equal(out.images[0], first.images[0])


def test_an_unseeded_request_is_not_stored(cached):
    first, _ = run(cached, "a", "a red square", P(seed=None))
    second, _ = run(cached, "b", "a red square", P(seed=None))
    assert not second.metrics.result_cache_hit
    stats = cached.stats()
    assert (stats["result_cache_entries"], stats["result_cache_queries"], stats["result_cache_hits"]) == (0, 0, 0)
    # Its drawn seed, sent back explicitly, is a request like any seeded one: stored now.
    run(cached, "c", "a red square", P(seed=first.seed))
    assert cached.stats()["result_cache_entries"] == 1


def test_mutating_returned_images_does_not_change_the_next_hit(cached):
    first, _ = run(cached, "a", "a red square", P())
    pixels = first.images[0].copy()
    first.images[0][:] = 0  # the client's own image: the cache holds a copy
    hit, _ = run(cached, "b", "a red square", P())
    np.testing.assert_array_equal(hit.images[0], pixels)
    hit.images[0][:] = 1  # and hands out copies
    again, _ = run(cached, "c", "a red square", P())
    np.testing.assert_array_equal(again.images[0], pixels)


def test_failed_and_aborted_requests_are_not_stored(cached):
    cached.add_request("gone", "a red square", P())
    cached.step()
    assert cached.abort_request("gone")
    while cached.has_unfinished_requests():
        cached.step()
    assert cached.stats()["result_cache_entries"] == 0 and not cached._result_keys


def test_a_hit_may_not_take_an_id_in_use(cached):
    run(cached, "a", "a red square", P())
    cached.add_request("busy", "something else", P())  # in flight
    with pytest.raises(ValueError, match="already in use"):
        cached.add_request("busy", "a red square", P())
    cached.add_request("hit", "a red square", P())
    with pytest.raises(ValueError, match="already in use"):  # its output not handed out yet
        cached.add_request("hit", "a red square", P())
    while cached.has_unfinished_requests():
        cached.step()


def test_the_cache_is_off_by_default(sd_eps_path):
    engine = make_engine(sd_eps_path)
    assert engine.config.result_cache_mb == 0
    run(engine, "a", "a red square", P())
    before = steps_run(engine)
    out, _ = run(engine, "b", "a red square", P())
    assert not out.metrics.result_cache_hit and steps_run(engine) > before
    stats = engine.stats()
    assert all(stats[k] == 0 for k in ("result_cache_hits", "result_cache_queries", "result_cache_bytes",
                                       "result_cache_entries"))
    assert engine.processor.process("k", "a red square", P()).result_key is None  # nothing hashed


def test_a_reloaded_or_reweighted_adapter_misses(sd_eps_path, tmp_path):
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    adapter = make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=1)
    engine = make_engine(sd_eps_path, result_cache_mb=1, lora_modules={"style": adapter})
    run(engine, "a", "a red square", P(loras={"style": 1.0}))
    assert run(engine, "b", "a red square", P(loras={"style": 1.0}))[0].metrics.result_cache_hit
    assert not run(engine, "c", "a red square", P(loras={"style": 0.5}))[0].metrics.result_cache_hit
    engine.unload_lora("style")
    engine.load_lora("style", adapter)  # the same file loaded again: another adapter (a new load id)
    assert not run(engine, "d", "a red square", P(loras={"style": 1.0}))[0].metrics.result_cache_hit


# -- the key ---------------------------------------------------------------------------------------------

def test_the_key_covers_adapters_and_input_pixels(engine):
    params = P().resolve(engine.model_info, engine.config)
    base = result_key("m", "p", params, ((1, 1.0),), "img", None)
    assert base == result_key("m", "p", params, ((1, 1.0),), "img", None)
    for other in (result_key("m", "p", params, ((1, 0.5),), "img", None),
                  result_key("m", "p", params, ((2, 1.0),), "img", None),
                  result_key("m", "p", params, (), "img", None),
                  result_key("m", "p", params, ((1, 1.0),), "other pixels", None),
                  result_key("m", "p", params, ((1, 1.0),), "img", "a mask"),
                  result_key("another model", "p", params, ((1, 1.0),), "img", None)):
        assert other != base


def test_the_key_covers_controls_and_the_image_prompt(engine):
    params = P().resolve(engine.model_info, engine.config)
    control = ("edges", "digest", 1.0, 0.0, 1.0)
    base = result_key("m", "p", params, (), "img", None, (control,), ("prompt pixels", 1.0))
    assert base == result_key("m", "p", params, (), "img", None, (control,), ("prompt pixels", 1.0))
    others = [result_key("m", "p", params, (), "img", None, (), ("prompt pixels", 1.0)),
              result_key("m", "p", params, (), "img", None, (control,), None),
              result_key("m", "p", params, (), "img", None, (control,), ("other pixels", 1.0)),
              result_key("m", "p", params, (), "img", None, (control,), ("prompt pixels", 0.5))]
    others += [result_key("m", "p", params, (), "img", None, (control[:i] + (x,) + control[i + 1:],),
                          ("prompt pixels", 1.0)) for i, x in enumerate(("depth", "other", 0.5, 0.2, 0.8))]
    assert base not in others and len(set(others)) == len(others)


# -- the LRU ---------------------------------------------------------------------------------------------

def test_lru_evicts_least_recently_used_within_the_byte_bound():
    cache = ResultCache(100)
    a, b, c = (np.full(40, i, dtype=np.uint8) for i in range(3))
    assert cache.put(b"a", [a]) and cache.put(b"b", [b])
    assert cache.get(b"a") is not None  # a is now the most recently used
    assert cache.put(b"c", [c])  # 120 > 100: b goes
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    assert cache.num_bytes == 80 <= cache.max_bytes and len(cache) == 2
    assert not cache.put(b"big", [np.zeros(101, dtype=np.uint8)])  # bigger than the whole budget
    assert b"big" not in cache and len(cache) == 2
    assert cache.put(b"a", [np.zeros(100, dtype=np.uint8)])  # replacing an entry frees its old bytes first
    assert cache.num_bytes == 100 and len(cache) == 1
    assert cache.get(b"missing") is None
    assert cache.stats() == {"result_cache_hits": 1, "result_cache_queries": 2, "result_cache_bytes": 100,
                             "result_cache_entries": 1}


def test_lru_copies_in_and_out_and_sizes_every_output_type():
    cache = ResultCache(10_000)
    array = np.arange(12, dtype=np.float32)
    cache.put(b"k", [array])
    array[:] = -1
    out = cache.get(b"k").images[0]
    out[:] = -2
    np.testing.assert_array_equal(cache.get(b"k").images[0], np.arange(12, dtype=np.float32))
    tensor = torch.ones(2, 3, dtype=torch.float16)
    cache.put(b"t", [tensor])
    tensor.zero_()
    assert torch.equal(cache.get(b"t").images[0], torch.ones(2, 3, dtype=torch.float16))
    assert image_nbytes(torch.ones(2, 3, dtype=torch.float16)) == 12
    assert image_nbytes(Image.new("RGB", (4, 5))) == 60 and image_nbytes(Image.new("L", (4, 5))) == 20
    assert image_nbytes(array) == 48
    assert not ResultCache(0).put(b"k", [array]) and not ResultCache(0).enabled


# -- config and flags -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 1.5, "64", True, None])
def test_bad_result_cache_mb_is_a_value_error(value):
    with pytest.raises(ValueError, match="result_cache_mb must be an integer >= 0"):
        EngineConfig(result_cache_mb=value)


def test_the_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--result-cache-mb", "64"]))["result_cache_mb"] == 64
    assert engine_kwargs(parser.parse_args([]))["result_cache_mb"] == 0


# -- the server --------------------------------------------------------------------------------------------

def test_metrics_count_hits(sd_eps_path):
    from fastapi.testclient import TestClient
    from utils_server import FAST

    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.entrypoints.api_server import build_app

    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32,
                                  result_cache_mb=1)
    try:
        with TestClient(build_app(engine, argparse.Namespace())) as client:
            body = {"prompt": "a red square", "seed": 3, **FAST}
            first, second = (client.post("/v1/images/generations", json=body) for _ in range(2))
            text = client.get("/metrics").text
        assert first.status_code == second.status_code == 200
        assert first.json()["data"] == second.json()["data"]
    finally:
        asyncio.run(engine.shutdown(0))
    assert "dvllm_result_cache_hits_total 1.0" in text and "dvllm_result_cache_queries_total 2.0" in text
    assert "dvllm_result_cache_entries 1.0" in text
