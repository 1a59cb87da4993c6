"""GPU pool sizing, on the CPU: the device memory queries are faked, the worst step is real."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.worker.memory_profile import gpu_pool_bytes, largest_size

GIB = 2**30


@pytest.fixture(scope="module")
def adapter(sd_eps_path):
    return DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").executor.worker.runner.adapter


class Recorded:
    """Records what each adapter call was given."""

    def __init__(self, adapter, monkeypatch) -> None:
        self.calls: list[tuple[str, object]] = []
        for name, shape_of in (("denoise", lambda a: tuple(a[0].shape)), ("decode", lambda a: tuple(a[0].shape)),
                               ("encode_prompt", lambda a: len(a[0]))):
            real = getattr(adapter, name)

            def wrapped(*args, _real=real, _name=name, _shape=shape_of, **kwargs):
                self.calls.append((_name, _shape(args)))
                return _real(*args, **kwargs)

            monkeypatch.setattr(adapter, name, wrapped)


class FakeMemory:
    """Answers each measurement with the bytes set for the adapter method the measured work called."""

    def __init__(self, recorded: Recorded, peaks: dict[str, int], free: int, total: int) -> None:
        self.recorded, self.peaks, self.free, self.total = recorded, peaks, free, total

    def measure(self, run) -> int:
        first = len(self.recorded.calls)
        run()
        called = self.recorded.calls[first:]
        return self.peaks[called[0][0]] if called else 0  # (nothing of the adapter's ran on this device)

    def free_and_total(self) -> tuple[int, int]:
        return self.free, self.total


def test_the_pool_gets_what_the_worst_of_encode_denoise_and_decode_leaves(adapter, monkeypatch):
    recorded = Recorded(adapter, monkeypatch)
    config = EngineConfig(max_batch_size=6, max_image_pixels=48 * 48, max_decode_batch=3, decode_stage=False)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 3 * GIB, "decode": 5 * GIB}  # the VAE is the worst here
    memory = FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB)
    budget, _ = gpu_pool_bytes(adapter, config, memory)
    assert budget == int(80 * GIB * 0.9) - 20 * GIB - 5 * GIB
    info = adapter.info
    assert largest_size(info, 48 * 48) == (48, 48)
    calls = dict(recorded.calls)
    assert calls["denoise"] == (6, *info.latents.shape(48, 48))  # a full forward at the largest size
    assert calls["decode"] == (3, *info.latents.shape(48, 48))   # one decode chunk at the largest size
    assert calls["encode_prompt"] == 12  # a full admission: a prompt and a negative per row


def test_cuda_graphs_and_padded_batches_are_counted(adapter, monkeypatch):
    recorded = Recorded(adapter, monkeypatch)
    config = EngineConfig(max_batch_size=5, max_image_pixels=32 * 32, cuda_graph=True, decode_stage=False)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 4 * GIB, "decode": 2 * GIB}
    budget, _ = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=70 * GIB, total=80 * GIB))
    info = adapter.info
    # each of max_cuda_graphs graphs keeps its bucket's inputs: latents, text conditions, timestep and guidance
    inputs = 8 * (4 * (math.prod(info.latents.shape(32, 32)) + sum(math.prod(s) for s in info.text.condition_shapes.values()))
                  + 2 * 4)
    assert budget == int(80 * GIB * 0.9) - 10 * GIB - 4 * GIB - 4 * GIB - 16 * inputs  # and the graphs' pool
    assert dict(recorded.calls)["denoise"][0] == 8  # 5 rows are padded to the bucket of 8


def test_step_caching_forwards_are_counted_beyond_the_plain_one(flux_path, monkeypatch):
    """A caching family's denoiser peak grows by what a caching forward holds beyond a plain one: two
    hidden-stream tensors of every row (its kept state is updated in place in the pool, not copied)."""
    adapter = DiffusionEngine(model=flux_path, device="cpu", dtype="float32").executor.worker.runner.adapter
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 4 * GIB, "decode": 2 * GIB}
    config = EngineConfig(max_batch_size=3, max_image_pixels=32 * 32, decode_stage=False)
    budget, _ = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=70 * GIB, total=80 * GIB))
    layout = adapter.info.cache_layout
    assert layout.hidden_kind == "image"  # Flux's blocks' hidden stream: one token per latent patch
    tokens = layout.image_tokens(32, 32)
    assert budget == int(80 * GIB * 0.9) - 10 * GIB - 4 * GIB - 2 * 3 * tokens * layout.inner_dim * 4


def test_lora_slot_tables_are_held_back_at_their_largest(adapter, monkeypatch):
    """The tables worker/lora_layers.py allocates for every layer an adapter may change (Linear and Conv2d, of
    the UNet and the text encoder), in max_loras slots of max_lora_rank, with a table of B's biases for every Linear
    one (made when an adapter with biases is loaded, so made here as such an adapter would)."""
    from dvllm.lora.weights import servable
    from dvllm.worker.lora_layers import _Table

    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 2 * GIB, "decode": 1 * GIB}
    config = EngineConfig(max_batch_size=2, max_image_pixels=32 * 32, enable_lora=True, max_loras=3, max_lora_rank=8, decode_stage=False)
    pipe = adapter.pipeline
    layers = [m for model in (pipe.unet, pipe.text_encoder) for m in model.modules() if servable(m)]
    assert any(isinstance(m, torch.nn.Conv2d) for m in layers)  # the UNet's convs have tables too
    tables = 0
    for m in layers:
        table = _Table(m, 3, 8)
        if isinstance(m, torch.nn.Linear):
            table.set_bias(0, torch.zeros(m.out_features))
        tables += sum(t.numel() for t in (table.a, table.bt, table.bias) if t is not None) * table.a.element_size()
    budget, _ = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=70 * GIB, total=80 * GIB))
    assert budget == int(80 * GIB * 0.9) - 10 * GIB - 2 * GIB - tables


def test_a_worst_step_that_leaves_nothing_is_refused_naming_the_knobs(adapter, monkeypatch):
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 9 * GIB, "decode": 2 * GIB}
    with pytest.raises(ValueError, match=r"worst step 9\.0 GiB more .*denoise 9\.0.*max_image_pixels"):
        gpu_pool_bytes(adapter, EngineConfig(decode_stage=False), FakeMemory(recorded, peaks, free=10 * GIB, total=80 * GIB))


@pytest.mark.parametrize("decode_stage", [False, True])
def test_finishers_decode_in_chunks_of_max_decode_batch_and_stay_exact(sd_eps_path, monkeypatch, decode_stage):
    prompts = [f"shape {i}" for i in range(3)]
    params = [SamplingParams(seed=i, num_inference_steps=2, n=n, output_type="np") for i, n in enumerate((1, 3, 1))]
    reference = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_decode_batch=8,
                                decode_stage=False)
    expected = reference.generate(prompts, params, use_tqdm=False)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_decode_batch=2,
                             decode_stage=decode_stage)
    adapter, sizes = engine.executor.worker.runner.adapter, []
    real = adapter.decode
    monkeypatch.setattr(adapter, "decode", lambda latents, size: sizes.append(len(latents)) or real(latents, size))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert sorted(sizes) == [1, 1, 1, 2]  # each request's images in calls of their own, at most two a call
    for got, want in zip(outs, expected):
        for a, b in zip(got.images, want.images):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_worst_step_that_runs_out_of_memory_is_refused_up_front(adapter, monkeypatch):
    import torch

    recorded = Recorded(adapter, monkeypatch)

    class OutOfMemory(FakeMemory):
        def measure(self, run) -> int:
            raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ValueError, match=r"encode ran out of memory .* lower max_batch_size, max_image_pixels"):
        gpu_pool_bytes(adapter, EngineConfig(), OutOfMemory(recorded, {}, free=1, total=2))


@pytest.mark.parametrize("decode_gib, asked, on", [(5, None, True), (30, None, False), (30, False, False), (5, True, True)])
def test_auto_runs_the_decode_stage_where_the_pool_keeps_at_least_half(adapter, monkeypatch, decode_gib, asked, on):
    """Unset, the decode stage runs unless reserving its VAE beside the loop's denoise (and its queue) leaves the
    pool less than half of what it has without: 44 of 47 GiB keeps it on; 2 of 22 GiB turns it off."""
    recorded = Recorded(adapter, monkeypatch)
    config = EngineConfig(max_batch_size=2, max_image_pixels=32 * 32, decode_stage=asked)
    peaks = {"encode_prompt": 1 * GIB, "denoise": (3 if decode_gib == 5 else 20) * GIB, "decode": decode_gib * GIB}
    budget, stage = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB))
    assert stage is on
    loop_only = int(80 * GIB * 0.9) - 20 * GIB - decode_gib * GIB
    if on:
        assert budget < loop_only and 2 * budget >= loop_only  # the stage's VAE and queue are reserved
    else:
        assert budget == loop_only


def test_a_forced_decode_stage_that_leaves_nothing_says_how_to_turn_it_off(adapter, monkeypatch):
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 30 * GIB, "decode": 30 * GIB}
    with pytest.raises(ValueError, match=r"decode stage decodes beside the loop.*--no-decode-stage"):
        gpu_pool_bytes(adapter, EngineConfig(decode_stage=True), FakeMemory(recorded, peaks, free=60 * GIB,
                                                                             total=80 * GIB))


def test_decode_workers_keep_the_stage_on_with_no_vae_beside_the_loop(adapter, monkeypatch):
    """Decode worker processes decode on other devices: the stage runs (auto would turn it off here), the VAE's
    peak counts only as the loop's own decode (when the stage is full), and the queue's latents are reserved."""
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 20 * GIB, "decode": 30 * GIB}
    config = EngineConfig(max_batch_size=2, max_image_pixels=32 * 32, decode_workers=1)
    budget, stage = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB))
    loop_only = int(80 * GIB * 0.9) - 20 * GIB - 30 * GIB
    assert stage is True and 0 < loop_only - budget < GIB  # less only the decode queue's latents


def test_encode_workers_take_the_text_encoders_work_off_the_gpu(adapter, monkeypatch):
    """With encode workers the profile runs no text encoder here (the worker holds none): their peak is neither
    beside the loop nor in it; only what the stage holds ready (on this device) is reserved."""
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 30 * GIB, "denoise": 20 * GIB, "decode": 1 * GIB}
    limits = dict(max_batch_size=2, max_image_pixels=32 * 32, decode_stage=False)
    memory = FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB)
    budget, _ = gpu_pool_bytes(adapter, EngineConfig(encode_workers=1, **limits), memory)
    assert "encode_prompt" not in {name for name, _ in recorded.calls}
    loop_only = int(80 * GIB * 0.9) - 20 * GIB - 20 * GIB
    assert 0 < loop_only - budget < GIB  # less only the texts held ready
    threads, _ = gpu_pool_bytes(adapter, EngineConfig(encode_stage=True, **limits), memory)
    assert threads <= budget - 30 * GIB  # the stage's thread encodes beside the loop
