"""The built-in tiny-shapes-dit (a tiny SD3 without T5, scripts/train_tiny_shapes_dit.py): it loads by name
with its defaults, dvllm's images equal diffusers' at its short text length, and a folder's
dvllm_defaults.json may set max_sequence_length only where the pipeline pads text with zeros."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.models.loader import builtin_folder
from dvllm.param_defaults import DEFAULTS_FILE

TOL = 1e-3
NAME = "tiny-shapes-dit"


@pytest.fixture(scope="module")
def folder() -> str:
    path = builtin_folder(NAME)
    assert path is not None, f"{NAME} is not shipped (run scripts/train_tiny_shapes_dit.py)"
    return path


@pytest.fixture(scope="module")
def length(folder) -> int:
    with open(f"{folder}/{DEFAULTS_FILE}") as f:
        return json.load(f)["max_sequence_length"]


@pytest.fixture(scope="module")
def engine() -> DiffusionEngine:
    return DiffusionEngine(model=NAME, device="cpu", dtype="float32")


def test_loads_by_name_with_its_defaults(engine, length):
    info = engine.model_info
    assert (engine.loaded_model.name, info.family, info.pipeline_class) == (NAME, "stable-diffusion-3", "StableDiffusion3Pipeline")
    assert (info.defaults.steps, info.defaults.height, info.defaults.width) == (28, 64, 64)
    assert length < 256  # far fewer zero tokens than the pipeline's default
    assert info.text.max_sequence_length == length and info.text.sequence_length_range == (length, length)
    # CLIP's tokens, then the zero tokens; the step cache sizes its text state from the same shape
    assert info.text.condition_shapes["prompt_embeds"][0] == 16 + length
    assert info.cache_layout.text_tokens == 16 + length


def test_matches_the_diffusers_pipeline(engine, folder, length):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(folder, dtype=torch.float32, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    cases = [("a red circle", 1000, 3.5), ("a small blue star on the left", 1001, 5.0), ("", 7, 1.0)]
    params = [SamplingParams(num_inference_steps=6, guidance_scale=g, seed=s, height=64, width=64,
                             output_type="np") for _, s, g in cases]
    outs = engine.generate([p for p, _, _ in cases], params, use_tqdm=False)
    for (prompt, seed, guidance), out in zip(cases, outs):
        assert out.error is None, out.error
        want = pipe(prompt, num_inference_steps=6, guidance_scale=guidance, height=64, width=64,
                    max_sequence_length=length, generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="np").images[0]
        assert out.images[0].shape == want.shape
        assert np.abs(out.images[0] - want).max() <= TOL


def test_a_request_may_name_the_models_length_only(engine, length):
    out = engine.generate(["a red circle"], SamplingParams(num_inference_steps=2, seed=1, max_sequence_length=length,
                                                           output_type="np"), use_tqdm=False)[0]
    assert out.error is None, out.error
    with pytest.raises(ValueError, match="max_sequence_length"):
        engine.generate(["a red circle"], SamplingParams(num_inference_steps=2, seed=1, max_sequence_length=256),
                        use_tqdm=False)


def _with_defaults(source: str, target, defaults: dict) -> str:
    shutil.copytree(source, target)
    (target / DEFAULTS_FILE).write_text(json.dumps(defaults))
    return str(target)


def test_max_sequence_length_is_refused_where_the_text_length_is_the_encoders(sd_eps_path, sd3_path, tmp_path):
    sd = _with_defaults(sd_eps_path, tmp_path / "sd", {"max_sequence_length": 8})
    with pytest.raises(ValueError, match="max_sequence_length: the stable-diffusion family takes no per-model"):
        DiffusionEngine(model=sd, device="cpu", dtype="float32")
    with_t5 = _with_defaults(sd3_path, tmp_path / "sd3", {"max_sequence_length": 8})
    with pytest.raises(ValueError, match="has a T5 encoder"):
        DiffusionEngine(model=with_t5, device="cpu", dtype="float32")
    unknown = _with_defaults(sd_eps_path, tmp_path / "unknown", {"max_length": 8})
    with pytest.raises(ValueError, match="unknown keys"):
        DiffusionEngine(model=unknown, device="cpu", dtype="float32")


@pytest.mark.parametrize("bad", [0, -3, "8", 2.5, True])
def test_max_sequence_length_must_be_a_positive_integer(folder, tmp_path, bad):
    path = _with_defaults(folder, tmp_path / "dit", {"max_sequence_length": bad})
    with pytest.raises(ValueError, match="positive integer"):
        DiffusionEngine(model=path, device="cpu", dtype="float32")


def test_other_lengths_of_a_t5less_sd3_are_served_as_its_pipeline_pads_them(folder, tmp_path):
    # the same weights told another length: dvllm follows the file, and still equals diffusers at that length
    from diffusers import StableDiffusion3Pipeline

    path = _with_defaults(folder, tmp_path / "dit4", {"max_sequence_length": 4, "num_inference_steps": 3})
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    assert engine.model_info.text.max_sequence_length == 4
    assert engine.model_info.text.condition_shapes["prompt_embeds"][0] == 20
    out = engine.generate(["a green square"], SamplingParams(seed=3, guidance_scale=2.0, output_type="np"),
                          use_tqdm=False)[0]
    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=torch.float32, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    want = pipe("a green square", num_inference_steps=3, guidance_scale=2.0, height=64, width=64,
                max_sequence_length=4, generator=torch.Generator("cpu").manual_seed(3), output_type="np").images[0]
    assert np.abs(out.images[0] - want).max() <= TOL
