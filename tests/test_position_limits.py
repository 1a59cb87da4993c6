"""A size past the denoiser's position tables is refused at admission: Z-Image's RoPE tables cover a fixed
number of tokens per side, and on a GPU an index past them is a device-side assert that ends the process (the
GPU run of 2026-12-04 met it in the memory profile's worst step). The memory profile's worst size stays inside."""
from __future__ import annotations

import pytest
import torch

from dvllm.config import EngineConfig
from dvllm.models.loader import load_adapter
from dvllm.sampling_params import SamplingParams
from dvllm.worker.memory_profile import largest_size


def test_z_image_sizes_stop_at_its_rope_tables(z_image_path):
    info = load_adapter(z_image_path, "auto", torch.device("cpu"), torch.float32).info
    # the tiny model's tables: 32 positions a side, a token per 2x2 latents of a 2x VAE: 128 pixels
    assert info.latents.max_side == 128
    config = EngineConfig(model=z_image_path, device="cpu", max_image_pixels=1024 * 1024)
    assert SamplingParams(height=128, width=64).resolve(info, config).height == 128
    with pytest.raises(ValueError, match="at most 128 for this model"):
        SamplingParams(height=64, width=136).resolve(info, config)
    assert largest_size(info, info.pixel_limit(config.max_image_pixels)) == (128, 128)


def test_wan_frames_and_sizes_stop_at_its_rope_table():
    """tiny-shapes-video's rotary table holds 32 positions along frames, height and width: 32 latent frames
    (125 frames: the first, then 4 a latent frame) and 32 patches of 2x2 latents of a 4x VAE (256 px). 129 frames
    were accepted and failed in the forward's reshape; now admission refuses them naming num_frames."""
    from dvllm import DiffusionEngine

    engine = DiffusionEngine(model="tiny-shapes-video", device="cpu", dtype="float32")
    info, config = engine.model_info, engine.config
    assert (info.video.max_frames, info.latents.max_side) == (125, 256)
    with pytest.raises(ValueError, match=r"num_frames must be at most 125 for this model"):
        engine.add_request("long", "a red circle moving to the right", SamplingParams(num_frames=129))
    with pytest.raises(ValueError, match=r"height and width must be at most 256 for this model"):
        SamplingParams(height=264, width=32).resolve(info, config)
    assert not engine.has_unfinished_requests()
    out = engine.generate("a red circle moving to the right",
                          SamplingParams(num_frames=125, num_inference_steps=1, output_type="np"), use_tqdm=False)[0]
    assert out.error is None and out.images[0].shape == (125, 32, 32, 3)  # the longest it has positions for
    assert largest_size(info, info.pixel_limit(config.max_image_pixels), 1000)[2] == 125
    from dvllm.entrypoints.model_facts import _video_facts

    assert _video_facts(info, config.max_num_frames)["video"]["max_num_frames"] == 125  # /v1/models: the lower
    engine.shutdown()


def test_default_frames_past_the_table_are_refused_at_start():
    from dvllm import DiffusionEngine

    with pytest.raises(ValueError, match=r"num_frames must be at most 125 for this model"):
        DiffusionEngine(model="tiny-shapes-video", device="cpu", default_params={"num_frames": 129})
