"""--encoder-device: the text encoders on another device than the denoiser. On the CPU the placement and the
checks are tested; the crossing itself (encoders on the CPU, denoiser on CUDA) where a GPU is present."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.models.loader import load_adapter

PARAMS = SamplingParams(num_inference_steps=3, seed=4, height=16, width=16, output_type="np")


def image(**kwargs) -> np.ndarray:
    engine = DiffusionEngine(dtype="float32", **kwargs)
    try:
        out = engine.generate(["a red circle"], [PARAMS], use_tqdm=False)[0]
    finally:  # its pool back to the device before the next engine sizes its own from what is left
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    assert out.error is None, out.error
    return out.images[0]


@pytest.mark.parametrize("fixture", ["sd_eps_path", "sdxl_path", "flux_path"])
def test_place_text_encoders_moves_every_text_encoder_and_nothing_else(request, fixture):
    adapter = load_adapter(request.getfixturevalue(fixture), "auto", torch.device("cpu"), torch.float32)
    adapter.place_text_encoders(torch.device("meta"))  # a device of its own, to see what moved
    moved = {name for name, c in adapter.pipeline.components.items()
             if isinstance(c, torch.nn.Module) and next(c.parameters()).device.type == "meta"}
    assert moved == {n for n in adapter.pipeline.components if n.startswith("text_encoder")
                     and adapter.pipeline.components[n] is not None}
    assert adapter.encoder_device == torch.device("meta") and adapter.device == torch.device("cpu")


@pytest.mark.parametrize("kwargs,error", [
    (dict(encoder_device="tpu"), "encoder_device must be"),
    (dict(encoder_device="cpu", enable_lora=True), "cannot be combined with LoRA"),
    (dict(encoder_device="cuda:1", num_workers=2, executor="ray"), "one GPU"),
])
def test_bad_encoder_devices_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the crossing needs a CUDA device")
@pytest.mark.parametrize("fixture", ["sd_eps_path", "sdxl_path", "flux_path", "qwen_image_path", "z_image_path"])
def test_encoders_on_the_cpu_give_the_images_of_encoders_on_the_gpu(request, fixture):
    path = request.getfixturevalue(fixture)
    np.testing.assert_allclose(image(model=path, device="cuda", encoder_device="cpu"),
                               image(model=path, device="cuda"), atol=1e-4, rtol=0)
