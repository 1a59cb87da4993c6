"""Fast mode (EngineConfig.fast): what it resolves to on this CPU, its images against the exact mode's within a
measured bound, LoRA and step-cached rows served beside compiled forwards, start-up graph capture (through the
CPU's graph emulator), and the combinations refused at start."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from graph_emulator import emulated_capture

from dvllm import DiffusionEngine, EngineConfig, SamplingParams
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.worker.denoiser import Denoiser
from dvllm.worker.fast_mode import fastest_attention
from dvllm.worker.regional_compile import RegionalCompile
from dvllm.worker.warm_up import warm_up

# Fast vs exact, largest |difference| of a [0, 1] pixel, float32 on the CPU, inductor: measured 1.1e-6 (tiny Flux,
# 4 steps, LoRA, first_block and plain rows) and 1.6e-6 (tiny SD, channels-last, 4 steps); bound ~6x that
BOUND = 1e-5


def _images(outputs) -> list[np.ndarray]:
    for out in outputs:
        assert out.error is None, out.error
    return [np.asarray(image) for out in outputs for image in out.images]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_fast_resolves_on_the_cpu(sd_eps_path, caplog):
    """No CUDA: no graphs, native attention; regional compile, warmed up at start; a UNet in channels-last."""
    with caplog.at_level(logging.INFO, logger="dvllm.startup"):
        engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", fast=True, compile_backend="eager")
    worker = engine.executor.worker
    settled = worker.config
    assert (settled.compile, settled.cuda_graph, settled.warm_up, settled.attention_backend, settled.channels_last) \
        == ("regional", False, True, "native", True)
    assert engine.config.compile is None  # the user's config keeps what was left unset
    unet = worker.runner.adapter.pipeline.unet
    assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert isinstance(worker.runner.denoiser.compiled, type(lambda: None))
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fast mode:")]
    assert len(line) == 1 and "compile regional (BasicTransformerBlock)" in line[0] and "CUDA graphs (no CUDA)" in \
        line[0] and "FP8 (not asked" in line[0], line


def test_fast_leaves_what_the_user_set(flux_path):
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", fast=True, compile="off",
                             warm_up=False, channels_last=False, attention_backend="native")
    settled = engine.executor.worker.config
    assert (settled.compile, settled.warm_up, settled.channels_last, settled.attention_backend) == \
        ("off", False, False, "native")
    assert engine.executor.worker.runner.denoiser.compiled is None


def test_without_fast_nothing_changes(flux_path):
    settled = DiffusionEngine(model=flux_path, device="cpu", dtype="float32").executor.worker.config
    assert (settled.compile, settled.cuda_graph, settled.warm_up, settled.attention_backend, settled.channels_last) \
        == ("off", False, False, None, False)


class _Named(torch.nn.Module):
    pass


def _denoiser(name: str) -> torch.nn.Module:
    return type(name, (_Named,), {})()


@pytest.mark.parametrize("name,dtype,capability,installed,want", [
    ("FluxTransformer2DModel", torch.bfloat16, (9, 0), ["native", "flash", "_flash_3"], "_flash_3"),
    ("FluxTransformer2DModel", torch.bfloat16, (9, 0), ["native", "flash"], "flash"),
    ("WanTransformer3DModel", torch.float16, (8, 0), ["native", "flash", "_flash_3"], "flash"),
    ("FluxTransformer2DModel", torch.bfloat16, (7, 5), ["native", "flash"], "native"),
    ("FluxTransformer2DModel", torch.float32, (9, 0), ["native", "flash", "_flash_3"], "native"),
    ("QwenImageTransformer2DModel", torch.bfloat16, (9, 0), ["native", "flash", "_flash_3"], "native"),
    ("UNet2DConditionModel", torch.float16, (9, 0), ["native", "flash", "_flash_3"], "native"),
])
def test_the_fastest_attention_is_one_that_cannot_fail(name, dtype, capability, installed, want, monkeypatch):
    """flash-attn's kernels take no mask and half precision only: chosen where neither can bite."""
    monkeypatch.setattr("dvllm.worker.fast_mode.installed_backends", lambda: installed)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fastest_attention(_denoiser(name), torch.device("cuda"), dtype)[0] == want
    assert fastest_attention(_denoiser(name), torch.device("cpu"), dtype) == ("native", "no CUDA")


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match=r"worker group .*fast"):
        ParallelConfig.of(EngineConfig(fast=True, cfg_parallel_size=2))
    with pytest.raises(ValueError, match=r"worker group .*fast"):
        ParallelConfig.of(EngineConfig(fast=True, sequence_parallel_size=2))
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig(compile="everything")
    with pytest.raises(ValueError, match="compile_backend is set but compile is 'off'"):
        EngineConfig(compile_backend="eager")
    assert EngineConfig(fast=True, compile_backend="eager").compile_backend == "eager"  # fast compiles
    with pytest.raises(ValueError, match="compile_backend is set but compile is 'off'"):
        EngineConfig(fast=True, compile="off", compile_backend="eager")
    with pytest.raises(ValueError, match="warm_up must be true or false"):
        EngineConfig(warm_up="yes")
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        EngineConfig(fast=True, cuda_graph=True, device="cpu")
    with pytest.raises(ValueError, match="no repeated blocks"):
        RegionalCompile([torch.nn.Linear(2, 2)], "eager")


@pytest.mark.slow
def test_fast_flux_mixed_lora_and_cache_rows_within_the_bound(flux_path, tmp_path):
    """Inductor's kernels on the plain forwards: images within BOUND of the exact mode's. Forwards with LoRA or
    step-cached rows run the blocks uncompiled (their rows are the exact mode's), plain ones compiled."""
    from conftest import tiny_flux_pipeline
    from lora_utils import make_lora

    loras = {"style": make_lora(tiny_flux_pipeline(), str(tmp_path / "style"), seed=5)}
    cache = {"method": "first_block", "threshold": 0.5}
    params = [SamplingParams(num_inference_steps=4, seed=1, loras={"style": 0.8}, output_type="np"),
              SamplingParams(num_inference_steps=4, seed=2, cache=cache, output_type="np"),
              SamplingParams(num_inference_steps=6, seed=3, n=2, output_type="np")]  # alone for its last steps
    prompts = ["a red cat", "b", "a blue dog"]
    exact = _images(DiffusionEngine(model=flux_path, device="cpu", dtype="float32", lora_modules=loras)
                    .generate(prompts, params, use_tqdm=False))
    # (no warm-up: it compiles 1 and 2 rows at two sizes, 8 inductor builds of the blocks; test_fast_resolves_on_the_cpu
    # covers it, and serving compiles just the one shape this batch's compiled forwards take)
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", lora_modules=loras, fast=True,
                             warm_up=False)
    denoiser, compiled_rows = engine.executor.worker.runner.denoiser, []
    regional = denoiser.compiled

    def spy(latents, timesteps, conditions, guidance, layout):
        compiled_rows.append((len(latents), any(layout.row_loras)))
        return regional(latents, timesteps, conditions, guidance, layout)
    denoiser.compiled = spy
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert any(o.metrics.cached_steps for o in outputs)
    got = _images(outputs)
    diff = _max_diff(got, exact)
    print(f"fast vs exact, tiny Flux: max |diff| {diff:.3g}")
    assert diff <= BOUND
    assert compiled_rows and not any(lora for _, lora in compiled_rows)  # LoRA forwards never compiled
    assert _max_diff(got[:1], exact[:1]) == 0  # the LoRA request never met a compiled forward


@pytest.mark.slow
def test_fast_sd_unet_within_the_bound(sd_eps_path):
    """A UNet: its BasicTransformerBlocks compiled by inductor, its weights in channels-last."""
    params = [SamplingParams(num_inference_steps=4, guidance_scale=g, seed=s, n=n, output_type="np")
              for g, s, n in ((5.0, 1, 1), (1.0, 2, 2), (7.5, 3, 1))]
    prompts = ["a red cat", "b", "a blue dog"]
    exact = _images(DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
                    .generate(prompts, params, use_tqdm=False))
    fast = _images(DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", fast=True, warm_up=False)
                   .generate(prompts, params, use_tqdm=False))  # (no warm-up: as in the Flux case above)
    diff = _max_diff(fast, exact)
    print(f"fast vs exact, tiny SD: max |diff| {diff:.3g}")
    assert diff <= BOUND


def test_graphs_are_captured_at_start_and_never_while_serving(sd_eps_path):
    """warm_up with graphs (the CPU's graph emulator standing in for CUDA's): one graph per batch bucket at the
    default size before any request; serving replays them, captures nothing, and a size not warmed up runs
    without a graph. The images are the eager engine's."""
    params = [SamplingParams(num_inference_steps=3, guidance_scale=g, seed=s, output_type="np")
              for g, s in ((5.0, 1), (1.0, 2))]
    other = SamplingParams(num_inference_steps=3, seed=3, height=24, width=24, output_type="np")
    prompts = ["a", "b"]
    plain = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_batch_size=2)
    exact = _images(plain.generate(prompts + ["c"], params + [other], use_tqdm=False))
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_batch_size=2)
    runner = engine.executor.worker.runner
    config = dataclasses.replace(engine.executor.worker.config, warm_up=True)
    runner.denoiser = denoiser = Denoiser(runner.adapter, config, capture=emulated_capture)
    with torch.inference_mode():
        warmed = warm_up(denoiser, runner.adapter, runner.pool, runner.lora)
    assert warmed == denoiser.buckets == [1, 2, 4]
    size = runner.adapter.info.default_size
    assert sorted(key[0] for key in denoiser.graphs) == warmed and all(key[2] == size for key in denoiser.graphs)
    captured = dict(denoiser.graphs)
    got = _images(engine.generate(prompts + ["c"], params + [other], use_tqdm=False))
    assert denoiser.graphs == captured  # nothing captured while serving
    assert sum(g.graph.replays for g in captured.values()) >= 3
    assert _max_diff(got, exact) <= 1e-5  # the emulator replays eager's ops: float32 rounding of their order


@pytest.mark.slow
@pytest.mark.parametrize("fixture,frames", [("sdxl_path", None), ("sd3_path", None), ("qwen_image_path", None),
                                            ("z_image_path", None), ("wan_path", 5)])
def test_every_family_serves_in_fast_mode(fixture, frames, request):
    """Each family's repeated blocks are found and traced (dynamo's eager backend: the plumbing, not inductor's
    numerics), warmed up at start, and serve a CFG and a plain request with the exact mode's images."""
    path = request.getfixturevalue(fixture)
    video = {} if frames is None else {"num_frames": frames}
    params = [SamplingParams(num_inference_steps=3, guidance_scale=g, seed=s, height=32, width=32, output_type="np",
                             **video) for g, s in ((4.0, 1), (1.0, 2))]
    prompts = ["a red cat", "b"]
    exact = _images(DiffusionEngine(model=path, device="cpu", dtype="float32")
                    .generate(prompts, params, use_tqdm=False))
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", fast=True, compile_backend="eager")
    assert engine.executor.worker.config.compile == "regional"
    assert _max_diff(_images(engine.generate(prompts, params, use_tqdm=False)), exact) <= BOUND
