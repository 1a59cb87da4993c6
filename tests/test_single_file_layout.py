"""The single-file writer in single_file_layout.py is the exact inverse of diffusers' `from_single_file`: a tiny
pipeline written as one original-layout checkpoint loads back with bit-identical weights and images. No dvllm."""
from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from conftest import tiny_sd_pipeline, tiny_sdxl_pipeline
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES
from safetensors.torch import load_file
from single_file_layout import original_layout, save_single_file, tiny_sdxl_two_widths

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """With `config=` a local folder and local_files_only=True, loading must not touch the network at all."""
    def refuse(*args, **kwargs):
        raise AssertionError("from_single_file tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _deeper_sd_pipeline() -> StableDiffusionPipeline:
    """tiny_sd_pipeline with three blocks of two layers each, so no index in the layout can be a constant."""
    base = tiny_sd_pipeline()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32, 32), layers_per_block=2, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=4, norm_num_groups=8,
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=(8, 16, 16), layers_per_block=2, in_channels=3, out_channels=3, latent_channels=4,
        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    )
    pipe = StableDiffusionPipeline(**{**base.components, "unet": unet, "vae": vae}, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _load_both(pipe, tmp_path, **kwargs):
    """Saves `pipe` as a diffusers folder and as one checkpoint; returns (from_single_file, from_pretrained)."""
    folder = tmp_path / "folder"
    pipe.save_pretrained(folder)
    path = save_single_file(pipe, tmp_path / "model.safetensors")
    cls = type(pipe)
    single = cls.from_single_file(path, config=str(folder), local_files_only=True, **kwargs)
    reference = cls.from_pretrained(folder, local_files_only=True, **kwargs)
    for loaded in (single, reference):
        loaded.set_progress_bar_config(disable=True)
        _own_memory(loaded)
    return single, reference


def _own_memory(pipe) -> None:
    """Moves every weight out of the safetensors memory map into fresh allocations. CPU kernels pick their
    vectorised paths by pointer alignment, and the two files place tensors at different offsets: with identical
    weights the tiny UNet's outputs then differ by ~1e-6, which says nothing about the conversion."""
    with torch.no_grad():
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                for param in module.parameters():
                    param.data = param.data.clone()


def _assert_same_weights(original, loaded) -> None:
    assert loaded.components.keys() == original.components.keys()
    for name, module in original.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        want, got = module.state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys(), name
        for key, tensor in want.items():
            # A key the converter skipped stays on the meta device.
            assert got[key].device == tensor.device and torch.equal(got[key], tensor), f"{name}.{key}"


def _image(pipe) -> np.ndarray:
    image = pipe("a red cube", num_inference_steps=2, height=16, width=16, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(image).all()  # assert_allclose would call two NaN images equal
    return image


@pytest.mark.parametrize("build", [tiny_sd_pipeline, _deeper_sd_pipeline], ids=["conftest", "deeper"])
def test_sd_round_trip(build, tmp_path):
    pipe = build()
    single, reference = _load_both(pipe, tmp_path)
    _assert_same_weights(pipe, single)
    assert dict(single.scheduler.config) == dict(reference.scheduler.config)
    np.testing.assert_allclose(_image(single), _image(reference), atol=1e-6, rtol=0)


def test_sdxl_round_trip(tmp_path):
    pipe = tiny_sdxl_two_widths()
    # add_watermarker is an __init__ argument that model_index.json does not keep.
    single, reference = _load_both(pipe, tmp_path, add_watermarker=False)
    _assert_same_weights(pipe, single)
    assert dict(single.scheduler.config) == dict(reference.scheduler.config)
    np.testing.assert_allclose(_image(single), _image(reference), atol=1e-6, rtol=0)


def test_equal_width_text_encoders_are_ambiguous(tmp_path):
    """Known diffusers limitation, pinned so it is noticed when fixed: when both SDXL text encoders have the same
    width (as in conftest's tiny_sdxl_pipeline), `create_diffusers_clip_model_from_ldm` matches text_encoder_2
    against `conditioner.embedders.0` first (by position-embedding width) and loads text_encoder's weights into it,
    leaving its text_projection on the meta device. Single-file tests must use distinct widths."""
    pipe = tiny_sdxl_pipeline()
    single, _ = _load_both(pipe, tmp_path, add_watermarker=False)
    first = pipe.text_encoder.state_dict()
    second = single.text_encoder_2.state_dict()
    assert all(torch.equal(second[f"text_model.{k}"], v) for k, v in first.items())
    assert second["text_projection.weight"].is_meta


def test_layout_matches_original_checkpoints(tmp_path):
    """What the round trip cannot see (diffusers' converter accepts either form): the names and shapes that
    original checkpoints and other loaders use."""
    sd = load_file(save_single_file(tiny_sd_pipeline(), tmp_path / "sd.safetensors"))
    assert CHECKPOINT_KEY_NAMES["clip"] in sd
    assert "cond_stage_model.transformer.text_model.embeddings.position_ids" in sd
    for name in ("q", "k", "v", "proj_out"):
        assert sd[f"first_stage_model.encoder.mid.attn_1.{name}.weight"].shape == (16, 16, 1, 1)
        assert sd[f"first_stage_model.decoder.mid.attn_1.{name}.weight"].shape == (16, 16, 1, 1)
    # The decoder's up.0 is the full-resolution end, diffusers' last up block.
    assert sd["first_stage_model.decoder.up.0.block.0.nin_shortcut.weight"].shape == (8, 16, 1, 1)
    assert "first_stage_model.decoder.up.1.upsample.conv.weight" in sd
    assert "model.diffusion_model.input_blocks.3.0.skip_connection.weight" in sd
    assert "model.diffusion_model.input_blocks.2.0.op.weight" in sd
    assert "model.diffusion_model.output_blocks.1.2.conv.weight" in sd  # upsampler after an attention

    xl = original_layout(tiny_sdxl_two_widths())
    assert "model.diffusion_model.label_emb.0.0.weight" in xl
    assert CHECKPOINT_KEY_NAMES["clip_sdxl"] in xl and CHECKPOINT_KEY_NAMES["open_clip_sdxl"] in xl
    open_clip = "conditioner.embedders.1.model."
    assert xl[open_clip + "transformer.resblocks.1.attn.in_proj_weight"].shape == (96, 32)
    assert xl[open_clip + "text_projection"].shape == (32, 24)  # (width, projection_dim), transposed from diffusers
    assert not any(k.startswith(open_clip) and ("q_proj" in k or "text_model" in k) for k in xl)


def test_unconvertible_weights_are_refused():
    """diffusers' converter drops the LCM guidance embedding (`time_embedding.cond_proj`); writing it anyway would
    load as a silently different model, so the writer refuses."""
    with pytest.raises(ValueError, match="cond_proj"):
        original_layout(tiny_sd_pipeline(time_cond_proj_dim=8))
