"""The denoiser wrapper: bucketed padding, torch.compile, CUDA graphs; and the step profile."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, EngineConfig, SamplingParams
from dvllm.models.layout import BatchLayout
from dvllm.worker.denoiser import Denoiser, ForwardInputs, batch_buckets
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.lora_layers import LoraLayers


class RowWiseAdapter:
    """A stand-in whose output row depends only on its own input row, like a real denoiser."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.seen_rows: list[int] = []

    def denoise(self, latents, timesteps, conditions, guidance, layout):
        self.seen_rows.append(len(latents))
        scale = (timesteps + guidance)[:, None, None, None]
        return latents * scale + conditions["prompt_embeds"].mean(dim=(1, 2))[:, None, None, None]


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 16]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]  # multiples of 8 past 8: 17 rows run as 24, not 32
    assert next(b for b in batch_buckets(128) if b >= 17) == 24


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.slow
def test_bucketed_padding_changes_no_row(rows):
    adapter = RowWiseAdapter()
    denoiser = Denoiser(adapter, EngineConfig(compile="bucketed", max_batch_size=4))
    args = (torch.randn(rows, 4, 2, 2), torch.rand(rows), {"prompt_embeds": torch.randn(rows, 3, 5)}, torch.rand(rows))
    layout = BatchLayout.single((16, 16), rows)
    forward = denoiser.plan(layout, (), LoraLayers(None, 1, 4, ForwardHooks()))
    bucket = forward.layout.num_rows
    latents, timesteps, conditions, guidance = (_pad(a, bucket) if torch.is_tensor(a) else
                                                {k: _pad(v, bucket) for k, v in a.items()} for a in args)
    out = denoiser(forward, ForwardInputs(latents, timesteps, guidance, conditions), ForwardHooks())
    expected = adapter.denoise(*args, layout)
    assert adapter.seen_rows[0] == next(b for b in batch_buckets(8) if b >= rows)  # ran padded up
    torch.testing.assert_close(out, expected)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t[-1:].expand(rows - len(t), *t.shape[1:])])


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        EngineConfig(cuda_graph=True, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager(sd_eps_path):
    params = [SamplingParams(num_inference_steps=6, guidance_scale=g, seed=s, height=16, width=16, output_type="np")
              for g, s in ((5.0, 1), (1.0, 2), (7.5, 3))]
    prompts = ["a", "b", "c"]
    # each engine's pool is sized from what the device has left: the second takes its share beside the first's
    eager = DiffusionEngine(model=sd_eps_path, device="cuda", dtype="float32", gpu_memory_utilization=0.25)
    eager = eager.generate(prompts, params, use_tqdm=False)
    graphs = DiffusionEngine(model=sd_eps_path, device="cuda", dtype="float32", cuda_graph=True,
                             gpu_memory_utilization=0.5)
    for want, got in zip(eager, graphs.generate(prompts, params, use_tqdm=False)):
        np.testing.assert_allclose(got.images[0], want.images[0], atol=1e-3, rtol=0)


@pytest.mark.slow
def test_compiled_denoiser_keeps_fidelity(sd_eps_path):
    """torch.compile (dynamic batch) on the CPU: the same images as eager, for a mixed batch. Through AOT autograd's
    backend: what is dvllm's here is the dynamic-batch forward's trace and wiring, which that backend runs in full;
    inductor's kernels are checked on the UNet's and Flux's blocks by test_fast_mode (a whole-UNet inductor build is
    over a minute of this suite's CPU)."""
    params = [SamplingParams(num_inference_steps=steps, guidance_scale=g, seed=s, sampler=sampler, n=n,
                             height=16, width=16, output_type="np")
              for steps, g, s, sampler, n in ((5, 5.0, 1, "ddim", 1), (3, 1.0, 2, "euler_a", 2),
                                              (4, 7.5, 3, "dpmpp_2m", 1))]
    prompts = ["a", "b", "c"]
    eager = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    compiled = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", compile="dynamic",
                               compile_backend="aot_eager")
    denoiser, rows = compiled.executor.worker.runner.denoiser, []
    forward = denoiser.compiled

    def spy(latents, *args, **kwargs):
        rows.append(len(latents))
        return forward(latents, *args, **kwargs)
    denoiser.compiled = spy
    outs = compiled.generate(prompts, params, use_tqdm=False)
    assert len(set(rows)) > 1, rows  # the compiled forward served batches of several sizes
    for want, got in zip(eager, outs):
        assert got.error is None, got.error
        for a, b in zip(got.images, want.images):
            np.testing.assert_allclose(a, b, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_profile_splits_the_step(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", profile_steps=True)
    # Time the forwards ourselves, inside the in-process worker: the profile's "forward" phase encloses them.
    adapter = engine.executor.worker.runner.adapter
    forwards: list[tuple[int, float]] = []  # (rows, seconds) per call

    def timed_denoise(latents, *args, **kwargs):
        start = time.perf_counter()
        out = type(adapter).denoise(adapter, latents, *args, **kwargs)
        forwards.append((len(latents), time.perf_counter() - start))
        return out
    adapter.denoise = timed_denoise
    start = time.perf_counter()
    engine.generate(["a", "b"], SamplingParams(num_inference_steps=3, height=16, width=16), use_tqdm=False)
    wall = time.perf_counter() - start
    report = engine.profile()
    # Both requests take their 3 steps together: 3 steps, one forward each, of 2 requests x 2 CFG rows.
    assert report["steps"] == 3 and [rows for rows, _ in forwards] == [4, 4, 4]
    seconds = report["seconds"]
    assert set(seconds) == {"schedule", "encode", "gather", "forward", "update_scatter", "decode", "bookkeeping"}
    assert all(seconds[p] > 0 for p in ("schedule", "encode", "gather", "forward", "update_scatter", "decode"))
    # The profile's clock against the test's: the steps run inside generate(), the forwards inside their phase.
    assert 0 < report["total_seconds"] <= wall
    assert sum(t for _, t in forwards) <= seconds["forward"]
    # Every timed phase runs inside a step, so together they fit in the steps' wall time (bookkeeping is
    # the remainder, clamped at 0: summing it in would hide an overrun).
    assert sum(v for p, v in seconds.items() if p != "bookkeeping") <= report["total_seconds"]
    assert 0 < report["share_outside_forward"] < 1
    with pytest.raises(ValueError, match="profile_steps=True"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").profile()


@pytest.mark.slow
def test_compiled_denoiser_with_lora_layers_loaded_keeps_fidelity(sd_eps_path, tmp_path):
    """LoRA batches run eagerly; once adapters are loaded, batches without any still take the compiled
    forward through the wrapped layers. Both give the eager engine's images. What is tested is which forward
    each batch takes and dynamo's trace through the wrapped layers, so the eager backend (no inductor build, a
    third of the CPU time: test_compiled_denoiser_keeps_fidelity compiles this UNet with inductor)."""
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    adapters = {"style": make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=5)}
    params = [SamplingParams(num_inference_steps=4, guidance_scale=5.0, seed=s, height=16, width=16, output_type="np",
                             loras=loras) for s, loras in ((1, {"style": 0.7}), (2, None), (3, {"style": 1.0}))]
    prompts = ["a", "b", "c"]
    results = []
    for compile_mode in ("off", "dynamic"):
        backend = {} if compile_mode == "off" else {"compile_backend": "eager"}
        engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", compile=compile_mode,
                                 lora_modules=adapters, **backend)
        denoiser, compiled_rows = engine.executor.worker.runner.denoiser, []
        if compile_mode == "dynamic":
            compiled = denoiser.compiled

            def spy(latents, *args, _compiled=compiled, **kwargs):
                compiled_rows.append(len(latents))
                return _compiled(latents, *args, **kwargs)
            denoiser.compiled = spy
        mixed = engine.generate(prompts, params, use_tqdm=False)
        plain = engine.generate(prompts[1], params[1], use_tqdm=False)  # no adapter: the compiled path
        if compile_mode == "dynamic":  # only batches without a LoRA row took it: the lone plain request's two rows
            assert compiled_rows and set(compiled_rows) == {2}, compiled_rows
        results.append(mixed + plain)
    for want, got in zip(*results):
        assert got.error is None, got.error
        np.testing.assert_allclose(got.images[0], want.images[0], atol=1e-3, rtol=0)


def test_compile_backend_is_checked():
    """compile_backend names one of torch.compile's backends, and only with compile on."""
    assert EngineConfig(compile="dynamic", compile_backend="eager").compile_backend == "eager"
    with pytest.raises(ValueError, match=r"compile_backend must be one of \['inductor', 'aot_eager', 'eager'\]"):
        EngineConfig(compile="dynamic", compile_backend="tvm")
    with pytest.raises(ValueError, match="compile_backend is set but compile is 'off'"):
        EngineConfig(compile_backend="eager")
