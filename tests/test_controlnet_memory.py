"""The memory profile with controlnets loaded: its worst forward has controls on every row (MAX_CONTROLS a request,
the largest controlnet), so the denoiser's peak grows by their activations, and the prepared control images the
forward's requests hold are held back from the pool; an engine with controlnets serves its worst request.

Peaks are measured on the CPU by the tracker the memory estimate uses (dvllm/sizing/fake_memory.py, on real
tensors); the device's free and total memory are faked as tests/test_memory_profile.py fakes them.
"""
from __future__ import annotations

import pytest
from diffusers import ControlNetModel

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.controls import MAX_CONTROLS
from dvllm.sizing.fake_memory import TrackedMemory
from dvllm.worker.memory_profile import control_image_bytes, gpu_pool_bytes, step_peaks
from test_controlnet import control, control_image, tiny_controlnet
from test_memory_profile import GIB, FakeMemory, Recorded

LIMITS = dict(max_batch_size=4, max_image_pixels=32 * 32, max_decode_batch=1)


@pytest.fixture(scope="module")
def engine(sd_eps_path, tmp_path_factory):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(sd_eps_path, subfolder="unet")
    folder = tmp_path_factory.mktemp("controlnet-memory")
    nets = {}
    for name, seed, channels in (("small", 1, (8, 16)), ("large", 2, (16, 32))):
        tiny_controlnet(unet, seed).save_pretrained(folder / name)  # (8, 16): the tests' own
        if channels != (8, 16):  # a wider conditioning embedding: more weights, larger activations
            net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=channels,
                                            load_weights_from_unet=False)
            net.save_pretrained(folder / name)
        nets[name] = str(folder / name)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=nets, **LIMITS)
    yield engine
    engine.shutdown()


def test_the_worst_forward_with_controlnets_peaks_higher_and_only_the_denoiser_does(engine):
    worker = engine.executor.worker
    adapter, config = worker.runner.adapter, EngineConfig(**LIMITS)
    hooks = len(adapter.pipeline.unet._forward_pre_hooks)
    plain = step_peaks(adapter, config, TrackedMemory(None))
    controlled = step_peaks(adapter, config, TrackedMemory(None), controlnets=worker.controlnets)
    assert controlled["encode"] == plain["encode"] and controlled["decode"] == plain["decode"]
    # every row's images, the controlnet's activations and the residual sums the UNet is handed: well above a
    # single [rows, 3, H, W] image tensor
    assert controlled["denoise"] > plain["denoise"] + 4 * 3 * 32 * 32 * 4
    assert len(adapter.pipeline.unet._forward_pre_hooks) == hooks  # the profile's hook is gone with its forward


def test_the_pool_holds_back_the_forwards_control_images(engine, monkeypatch):
    worker = engine.executor.worker
    adapter, config = worker.runner.adapter, EngineConfig(decode_stage=False, **LIMITS)
    recorded = Recorded(adapter, monkeypatch)
    peaks = {"encode_prompt": 1 * GIB, "denoise": 3 * GIB, "decode": 2 * GIB}
    plain, _ = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB))
    with_nets, _ = gpu_pool_bytes(adapter, config, FakeMemory(recorded, peaks, free=60 * GIB, total=80 * GIB),
                                  controlnets=worker.controlnets)
    images = control_image_bytes(adapter, config, worker.controlnets)
    assert images == LIMITS["max_batch_size"] * MAX_CONTROLS * 3 * 32 * 32 * 4  # float32 [3, 32, 32] each
    assert plain - with_nets == images


def test_an_engine_with_controlnets_serves_its_worst_request(engine):
    """max_batch_size rows (n=2 with CFG) at the largest size, with MAX_CONTROLS controls."""
    controls = [control("large" if i % 2 else "small", control_image(i), scale=0.5) for i in range(MAX_CONTROLS)]
    out = engine.generate("a cat", SamplingParams(num_inference_steps=2, guidance_scale=5.0, n=2, height=32,
                                                  width=32, seed=1, controls=controls), use_tqdm=False)[0]
    assert out.error is None and len(out.images) == 2 and out.images[0].size == (32, 32)
