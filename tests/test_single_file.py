"""Single-file checkpoints and component overrides (models/single_file.py): a denoiser's one file with
--base-model, a whole SD checkpoint in the original layout, --vae as a folder or a file. Each is checked
against the same weights loaded as a diffusers folder, whose images are proven equal to diffusers elsewhere:
the images must be identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_flux_pipeline, tiny_sd_pipeline
from safetensors.torch import save_file
from single_file_layout import save_single_file, tiny_sdxl_two_widths

from dvllm import DiffusionEngine, SamplingParams

PARAMS = dict(num_inference_steps=3, seed=5, height=16, width=16, output_type="np")


def image(**engine_kwargs) -> np.ndarray:
    engine = DiffusionEngine(device="cpu", dtype="float32", **engine_kwargs)
    out = engine.generate(["a red circle"], [SamplingParams(**PARAMS)], use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.images[0]


def reseeded(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The same architecture with other weights, so a file that was not read cannot pass for one that was."""
    torch.manual_seed(seed)
    other = type(model).from_config(model.config)
    return other.eval()


@pytest.fixture(scope="module")
def flux_transformer_file(tmp_path_factory) -> tuple[str, str, str]:
    """(a Flux transformer as one diffusers-layout file, the folder it belongs to, that folder with the file's
    transformer in place of its own)."""
    root = tmp_path_factory.mktemp("flux-single")
    pipe = tiny_flux_pipeline()
    pipe.save_pretrained(root / "base")
    pipe.transformer = reseeded(pipe.transformer, 11)
    pipe.save_pretrained(root / "merged")
    file = root / "flux-finetune.safetensors"
    save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, str(file))
    return str(file), str(root / "base"), str(root / "merged")


def test_a_denoiser_file_with_its_base_model_gives_the_folders_image(flux_transformer_file):
    file, base, merged = flux_transformer_file
    got = image(model=file, base_model=base)
    np.testing.assert_array_equal(got, image(model=merged))
    assert np.abs(got - image(model=base)).max() > 1e-2  # the file's transformer ran, not the base's


def test_a_denoiser_file_without_a_base_model_is_refused_naming_the_flag(flux_transformer_file):
    file, _, _ = flux_transformer_file
    with pytest.raises(ValueError, match="one model's weights.*--base-model"):
        DiffusionEngine(model=file, device="cpu", dtype="float32")


def test_a_denoiser_file_of_another_model_is_refused_naming_both(flux_transformer_file, sd_eps_path):
    file, _, _ = flux_transformer_file
    with pytest.raises(ValueError, match=r"cannot read .*flux-finetune.safetensors as the unet"):
        DiffusionEngine(model=file, base_model=sd_eps_path, device="cpu", dtype="float32")


def test_pickles_and_unreadable_files_are_refused(tmp_path, sd_eps_path):
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"not read")
    with pytest.raises(ValueError, match="not pickles"):
        DiffusionEngine(model=str(pickle), base_model=sd_eps_path, device="cpu", dtype="float32")
    broken = tmp_path / "model.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        DiffusionEngine(model=str(broken), base_model=sd_eps_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="base_model names the pipeline of a single-file checkpoint"):
        DiffusionEngine(model=sd_eps_path, base_model=sd_eps_path, device="cpu", dtype="float32")


def with_other_weights(pipe):
    """The same pipeline with every model's weights drawn anew: a base whose weights must not be the ones used."""
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            torch.manual_seed(len(name))
            other = type(component).from_config(component.config) if hasattr(component, "from_config") \
                else type(component)(component.config)
            setattr(pipe, name, other.eval())
    return pipe


@pytest.mark.parametrize("build", [tiny_sd_pipeline, tiny_sdxl_two_widths], ids=["sd", "sdxl"])
@pytest.mark.slow
def test_a_whole_checkpoint_in_the_original_layout_gives_the_folders_image(build, tmp_path):
    """A civitai-style file (UNet, VAE and text encoders in the original key layout, written by the inverse of
    diffusers' conversion) with --base-model naming a folder of the same configs and other weights."""
    pipe = build()
    pipe.save_pretrained(tmp_path / "same-weights")
    file = save_single_file(pipe, str(tmp_path / "checkpoint.safetensors"))
    with_other_weights(build()).save_pretrained(tmp_path / "base")
    got = image(model=file, base_model=str(tmp_path / "base"))
    # Identical weights, read from two files: CPU kernels pick their paths by each tensor's alignment in its
    # memory map, which moves results by ~1e-6 (tests/single_file_layout.py's round trip shows it bit-exact)
    np.testing.assert_allclose(got, image(model=str(tmp_path / "same-weights")), atol=1e-5, rtol=0)
    assert np.abs(got - image(model=str(tmp_path / "base"))).max() > 1e-2


def test_a_whole_checkpoint_without_a_base_model_asks_for_its_kinds_configs(tmp_path):
    file = save_single_file(tiny_sd_pipeline(), str(tmp_path / "checkpoint.safetensors"))
    (tmp_path / "empty-cache").mkdir()
    with pytest.raises(ValueError, match="stable-diffusion-v1-5/stable-diffusion-v1-5.*could not be fetched"):
        DiffusionEngine(model=file, local_files_only=True, download_dir=str(tmp_path / "empty-cache"),
                        device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def other_vae(tmp_path_factory) -> tuple[str, str, str]:
    """(an SD VAE of other weights as a folder, the same as one file, the SD folder with that VAE in it)."""
    root = tmp_path_factory.mktemp("vae")
    pipe = tiny_sd_pipeline()
    pipe.vae = reseeded(pipe.vae, 12)
    pipe.vae.save_pretrained(root / "vae-folder")
    save_file({k: v.contiguous() for k, v in pipe.vae.state_dict().items()}, str(root / "vae.safetensors"))
    pipe.save_pretrained(root / "merged")
    return str(root / "vae-folder"), str(root / "vae.safetensors"), str(root / "merged")


@pytest.mark.slow
def test_vae_as_a_folder_or_a_file_replaces_the_models_own(other_vae, sd_eps_path):
    folder, file, merged = other_vae
    want = image(model=merged)
    np.testing.assert_array_equal(image(model=sd_eps_path, vae=folder), want)
    np.testing.assert_array_equal(image(model=sd_eps_path, vae=file), want)
    assert np.abs(want - image(model=sd_eps_path)).max() > 1e-2


def test_a_vae_that_cannot_be_read_is_refused_at_load(tmp_path, sd_eps_path):
    with pytest.raises(ValueError, match="--vae .*could be read"):
        DiffusionEngine(model=sd_eps_path, vae=str(tmp_path), device="cpu", dtype="float32")


def test_an_fp8_transformer_file_loads_as_its_rounded_weights(tmp_path):
    """A "flux1-dev-fp8.safetensors"-style file (weights stored as float8_e4m3fn, no scales) is read into the
    serving dtype: the images are those of a folder holding the same fp8-rounded weights."""
    pipe = tiny_flux_pipeline()
    pipe.save_pretrained(tmp_path / "base")
    fp8 = {k: (v.to(torch.float8_e4m3fn) if v.dim() >= 2 else v).contiguous()
           for k, v in pipe.transformer.state_dict().items()}
    save_file(fp8, str(tmp_path / "fp8.safetensors"))
    pipe.transformer.load_state_dict({k: v.float() for k, v in fp8.items()})
    pipe.save_pretrained(tmp_path / "rounded")
    got = image(model=str(tmp_path / "fp8.safetensors"), base_model=str(tmp_path / "base"))
    # (the upcast weights are fresh allocations, the folder's a memory map: ~1e-7 apart, as the whole-checkpoint
    # test explains; fp8's own rounding is larger by far)
    np.testing.assert_allclose(got, image(model=str(tmp_path / "rounded")), atol=1e-5, rtol=0)
    assert np.abs(got - image(model=str(tmp_path / "base"))).max() > 1e-3  # the rounding shows: the file was read
