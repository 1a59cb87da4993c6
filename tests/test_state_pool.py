"""The paged state pool through the engine: admission by blocks, the prompt cache, preemption."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams

SAMPLERS = ["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "lcm", "PNDMScheduler"]


def mixed_workload() -> tuple[list[str], list[SamplingParams]]:
    """24 requests: step counts, CFG on and off, samplers, priorities, two sizes, repeated prompts."""
    prompts, params = [], []
    for i in range(24):
        prompts.append(f"prompt {i % 5}")  # five distinct prompts: the rest are repeats
        params.append(SamplingParams(
            num_inference_steps=4 + i % 4, guidance_scale=(1.0, 4.0, 7.5)[i % 3], seed=100 + i,
            sampler=SAMPLERS[i % len(SAMPLERS)], n=1 + (i % 5 == 0), height=16 if i % 6 else 24, width=16,
            priority=i % 3, negative_prompt="dull" if i % 4 == 0 else None, output_type="np",
        ))
    return prompts, params


def run(engine: DiffusionEngine, prompts, params, arrivals_per_step: int):
    """Requests arrive a few per step, so urgent ones come while others run."""
    pending = list(zip(range(len(prompts)), prompts, params))
    outs = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(arrivals_per_step):
            if pending:
                i, prompt, p = pending.pop(0)
                engine.add_request(str(i), prompt, p)
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_small_pool_with_preemption_gives_the_unconstrained_images(sd_eps_path):
    prompts, params = mixed_workload()
    roomy = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", scheduling_policy="priority")
    tight = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", scheduling_policy="priority",
                            num_state_blocks=40, max_batch_size=8, priority_aging_iterations=4)
    expected = run(roomy, prompts, params, arrivals_per_step=24)
    got = run(tight, prompts, params, arrivals_per_step=2)

    stats = tight.stats()
    assert stats["pool_total_blocks"] == 40
    total_state = sum(r for r in _state_blocks(tight, prompts, params))
    assert total_state > 4 * 40, "the pool must be far smaller than the workload's state"
    assert stats["num_preemptions"] > 0, "the workload must exercise preemption"
    assert stats["prompt_cache_hits"] > 0
    assert stats["pool_used_blocks"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert tight.executor.worker.runner.states == {}
    for want, have in zip(expected, got):
        assert have.error is None, have.error
        assert len(have.images) == len(want.images)
        for a, b in zip(have.images, want.images):
            np.testing.assert_allclose(a, b, atol=1e-3, rtol=0)


def _state_blocks(engine, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        yield engine.processor.process(f"size-{i}", prompt, p).max_blocks


def test_prompt_cache_skips_the_text_encoder(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    adapter = engine.executor.worker.runner.adapter
    encoded = []
    real = adapter.encode_prompt
    adapter.encode_prompt = lambda texts: encoded.extend(texts) or real(texts)
    p = SamplingParams(num_inference_steps=2, guidance_scale=5.0, height=16, width=16, seed=1, output_type="np")
    first = engine.generate("a cached prompt", p, use_tqdm=False)[0]
    assert sorted(encoded, key=str) == sorted([("a cached prompt", False), (None, True)], key=str)
    encoded.clear()
    again = engine.generate("a cached prompt", p, use_tqdm=False)[0]
    both = engine.generate(["a cached prompt", "a cached prompt"], [p, p], use_tqdm=False)
    assert encoded == []  # every condition came from the cache
    np.testing.assert_array_equal(again.images[0], first.images[0])  # the very same embedding
    assert all(o.error is None for o in both)
    stats = engine.stats()
    assert stats["prompt_cache_queries"] == 8 and stats["prompt_cache_hits"] == 6
    assert stats["pool_used_blocks"] == 0 and stats["pool_cached_blocks"] > 0


@pytest.mark.slow
def test_requests_too_big_for_the_pool_are_refused_and_tiny_pools_at_start(sd_eps_path):
    with pytest.raises(ValueError, match="state pool is too small for even one default request"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", num_state_blocks=3)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", num_state_blocks=30,
                             max_image_pixels=64 * 64)
    with pytest.raises(ValueError, match="state-pool blocks but the pool has 30"):
        engine.add_request("big", "x", SamplingParams(n=8, height=64, width=64, guidance_scale=5.0))
    assert not engine.has_unfinished_requests()


def test_state_pool_mb_sizes_the_pool(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=1)
    block_bytes = engine.block_numel * 4
    assert engine.stats()["pool_total_blocks"] == 2**20 // block_bytes


@pytest.mark.slow
def test_fidelity_holds_with_the_pure_torch_reference_ops():
    """The fidelity suite again, with DVLLM_USE_CUSTOM_OPS=0 (the default run uses the C++ ops)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DVLLM_USE_CUSTOM_OPS": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(root / "tests" / "test_fidelity.py")],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
