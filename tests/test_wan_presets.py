"""The Wan presets: the published architectures build on the meta device with their checkpoints' parameter counts
and fit together as a WanPipeline, and wan-cpu generates a video on the CPU with dummy weights."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from dvllm import DiffusionEngine, SamplingParams
from dvllm.models import model_names
from dvllm.models.loader import dummy_components, load_preset, preset_names, resolve_model
from dvllm.models.registry import adapter_for

# Millions of parameters of the published checkpoints (their safetensors' sizes agree: the 1.3B's transformer is
# 5.68 GB in float32, UMT5-XXL's encoder 11.4 GB in bfloat16, Wan 2.2's VAE 2.82 GB in float32).
WAN21_VAE, WAN22_VAE, UMT5_XXL = 126.9, 704.7, 5680.9
PRESET_SIZES = {
    "wan2.1-t2v-1.3b": {"transformer": 1419.0, "vae": WAN21_VAE, "text_encoder": UMT5_XXL},
    "wan2.1-t2v-14b": {"transformer": 14288.5, "vae": WAN21_VAE, "text_encoder": UMT5_XXL},
    "wan2.2-ti2v-5b": {"transformer": 4999.8, "vae": WAN22_VAE, "text_encoder": UMT5_XXL},
    "wan2.2-t2v-a14b": {"transformer": 14288.5, "transformer_2": 14288.5, "vae": WAN21_VAE,
                        "text_encoder": UMT5_XXL},
}
# (spatial, temporal compression, latent channels, expand_timesteps, boundary_ratio)
LAYOUTS = {
    "wan2.1-t2v-1.3b": (8, 4, 16, False, None),
    "wan2.1-t2v-14b": (8, 4, 16, False, None),
    "wan2.2-ti2v-5b": (16, 4, 48, True, None),
    "wan2.2-t2v-a14b": (8, 4, 16, False, 0.875),
    "wan2.2-t2v-a14b-mlperf": (8, 4, 16, False, 0.875),
    "wan-cpu": (8, 4, 16, False, None),
}


def millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def test_the_wan_presets_are_listed():
    assert set(LAYOUTS) <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PRESET_SIZES))
def test_presets_build_the_published_architectures(name):
    """Each component at full size on the meta device (no memory), with the published checkpoint's count."""
    preset = load_preset(name)
    for component, expected in PRESET_SIZES[name].items():
        library, class_name = preset["model_index"][component]
        cls = getattr(importlib.import_module(library), class_name)
        config = preset["components"][component]
        with torch.device("meta"):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(cls.config_class(**config))
        assert millions(model) == pytest.approx(expected, rel=0.001), f"{name}/{component}: {millions(model):.1f}M"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_presets_make_a_wan_pipeline_whose_parts_fit(name):
    """As the loader builds them (weights on the meta device): the transformer reads the VAE's latents and the
    text encoder's states, the tokenizer pads to the 512 tokens the pipeline encodes."""
    source = resolve_model(name)
    components = dummy_components(source, adapter_for(source.pipeline_class), 0, meta=True)
    pipe = WanPipeline(**components)
    spatial, temporal, channels, expand, boundary = LAYOUTS[name]
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (spatial, temporal)
    assert (bool(pipe.config.expand_timesteps), pipe.config.boundary_ratio) == (expand, boundary)
    experts = [pipe.transformer] + ([pipe.transformer_2] if boundary is not None else [])
    assert (pipe.transformer_2 is None) == (boundary is None)
    for expert in experts:
        assert expert.config.in_channels == expert.config.out_channels == pipe.vae.config.z_dim == channels
        assert expert.config.text_dim == pipe.text_encoder.config.d_model
    assert pipe.tokenizer.model_max_length == 512
    assert pipe.scheduler.config.prediction_type == "flow_prediction" and pipe.scheduler.config.use_flow_sigmas


@pytest.fixture(scope="module")
def wan_cpu():
    return DiffusionEngine(model="wan-cpu", load_format="dummy", device="cpu", dtype="float32")


@pytest.mark.slow
def test_wan_cpu_is_wan_21_at_cpu_size(wan_cpu):
    info = wan_cpu.model_info
    assert info.family == "wan" and info.video.fps == 16.0 and info.video.frames == 81
    assert (info.latents.channels, info.latents.scale, info.latents.temporal_scale) == (16, 8, 4)
    assert info.text.max_sequence_length == 512
    transformer = wan_cpu.executor.worker.runner.adapter.pipeline.transformer
    assert millions(transformer) < 10  # CPU size: seconds a video, not minutes


def test_wan_cpu_generates_a_video_on_the_cpu(wan_cpu):
    params = SamplingParams(num_inference_steps=2, guidance_scale=5.0, height=32, width=64, num_frames=5, seed=3,
                            output_type="np")
    out = wan_cpu.generate("a lighthouse at dusk", params, use_tqdm=False)[0]
    assert out.error is None, out.error
    (video,) = out.images
    assert video.shape == (5, 32, 64, 3) and np.isfinite(video).all()
    assert 0.0 <= video.min() and video.max() <= 1.0


def test_the_mlperf_preset_is_the_a14b_architecture_at_mlperfs_settings():
    """MLPerf Inference v6.0's text-to-video clip: the A14B preset's architecture (its base, not a copy) with the
    benchmark's defaults (720x1280, 81 frames, 20 steps, guidance 4.0 then 3.0), as the loader applies them to the
    meta-device model (no weights)."""
    from dvllm.models.loader import _apply_defaults, _default_layers
    from dvllm.sizing.memory_estimate import _build

    mlperf, a14b = load_preset("wan2.2-t2v-a14b-mlperf"), load_preset("wan2.2-t2v-a14b")
    assert (mlperf["model_index"], mlperf["components"]) == (a14b["model_index"], a14b["components"])
    assert mlperf["base"] == "wan2.2-t2v-a14b" and "defaults" not in a14b
    adapter, source, _ = _build("wan2.2-t2v-a14b-mlperf", "bfloat16", "auto", False)
    _apply_defaults(adapter, source, _default_layers(source, None))
    info = adapter.info
    defaults = info.defaults
    assert (defaults.height, defaults.width, info.video.frames) == (720, 1280, 81)
    assert (defaults.steps, defaults.guidance, defaults.guidance_2) == (20, 4.0, 3.0)
    assert info.expert_boundary == 0.875 * 1000  # the architecture's boundary_ratio of the training timesteps


def test_a_preset_base_must_be_a_plain_preset(monkeypatch):
    presets = {"child": {"base": "missing"}, "grandchild": {"base": "child"}, "child2": {"base": "grandchild"}}
    monkeypatch.setattr(model_names, "_read_preset", presets.__getitem__)
    monkeypatch.setattr(model_names, "preset_names", lambda: sorted(presets))
    with pytest.raises(ValueError, match="preset 'child': its base 'missing' is not a preset"):
        model_names.load_preset("child")
    with pytest.raises(ValueError, match="preset 'child2': its base 'grandchild' has a base of its own"):
        model_names.load_preset("child2")
