"""A model's request defaults (models/model_defaults.py): the pipeline's, then the known table's (Turbo-kind
models, by Hub id), the folder's dvllm_defaults.json, then the engine's default_params, each over the one before;
what is in force is what requests get and what /v1/models says."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import _saved, tiny_wan_pipeline

from dvllm import DiffusionEngine, EngineConfig, SamplingParams
from dvllm.entrypoints.model_facts import model_facts
from dvllm.models import model_defaults
from dvllm.models.model_defaults import known_defaults


def test_turbo_kind_models_get_their_cards_defaults_not_their_pipelines():
    """Z-Image-Turbo's pipeline defaults are 50 steps with CFG (guidance 5.0): ~12x what it was distilled for."""
    assert known_defaults("Tongyi-MAI/Z-Image-Turbo") == {"num_inference_steps": 9, "guidance_scale": 0.0}
    assert known_defaults("z-image-turbo") == known_defaults("Tongyi-MAI/Z-Image-Turbo")  # the preset times it
    assert known_defaults("stabilityai/sdxl-turbo")["num_inference_steps"] == 1
    assert known_defaults("black-forest-labs/FLUX.1-dev") == {}  # its pipeline's defaults are its own


@pytest.mark.slow
def test_each_layer_of_defaults_over_the_one_before(sd_eps_path, tmp_path, monkeypatch):
    folder = tmp_path / "a-turbo"
    shutil.copytree(sd_eps_path, folder)
    # as if the folder were a Hub model the table knows
    monkeypatch.setitem(model_defaults.KNOWN_DEFAULTS, str(folder).lower(),
                        {"num_inference_steps": 2, "guidance_scale": 0.0, "height": 24})
    info = DiffusionEngine(model=str(folder), device="cpu", dtype="float32").model_info
    assert (info.defaults.steps, info.defaults.guidance, info.defaults.height) == (2, 0.0, 24)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"num_inference_steps": 3, "sampler": "euler"}))
    info = DiffusionEngine(model=str(folder), device="cpu", dtype="float32").model_info
    assert (info.defaults.steps, info.defaults.guidance, info.defaults.sampler) == (3, 0.0, "euler")
    engine = DiffusionEngine(model=str(folder), device="cpu", dtype="float32",
                             default_params='{"num_inference_steps": 4, "sampler": "euler_a"}')  # as the flag
    info = engine.model_info
    assert (info.defaults.steps, info.defaults.height, info.defaults.sampler) == (4, 24, "euler_a")
    facts = model_facts(info, 4096, engine.valid_samplers())  # what /v1/models says
    assert (facts["num_inference_steps"], facts["guidance_scale"], facts["sampler"]) == (4, 0.0, "euler_a")
    assert facts["default_size"] == f"{info.defaults.width}x24"


def test_a_default_sampler_runs_as_if_the_request_named_it(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", default_params={"sampler": "euler_a"})
    plain = SamplingParams(seed=4, num_inference_steps=3, output_type="np")
    named = SamplingParams(seed=4, num_inference_steps=3, output_type="np", sampler="euler_a")
    first, second = engine.generate(["a red circle"] * 2, [plain, named], use_tqdm=False)
    np.testing.assert_array_equal(first.images[0], second.images[0])
    other = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")  # its own scheduler: another image
    assert not np.array_equal(other.generate(["a red circle"], [plain], use_tqdm=False)[0].images[0],
                              first.images[0])


@pytest.mark.parametrize("value, message", [
    ('{"steps": 8}', "unknown keys \\['steps'\\]"),
    ("{not json", "not valid JSON"),
    ('{"num_inference_steps": 0}', "num_inference_steps must be a positive integer"),
    ('{"guidance_scale": -1}', "guidance_scale must be a finite number >= 0"),
    ('{"guidance_scale_2": "3"}', "guidance_scale_2 must be a finite number >= 0"),
    ('{"sampler": "eulr"}', "did you mean 'euler'"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_default_params_are_refused_before_the_model_loads(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(default_params=value)


def test_a_video_models_frames_and_rate_come_from_its_defaults(wan_path, sd_eps_path, tmp_path):
    """num_frames and fps as defaults (a video model's ModelInfo.video): Wan 2.2 TI2V-5B's card is 704x1280, 121
    frames at 24 fps, where its pipeline says 480x832 and 81; a folder's own file sets them too. Image models and
    frame counts the VAE cannot pack are refused, naming the file."""
    assert known_defaults("wan2.2-ti2v-5b") == {"height": 704, "width": 1280, "num_frames": 121, "fps": 24}
    folder = tmp_path / "wan"
    shutil.copytree(wan_path, folder)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"num_frames": 9, "fps": 8, "height": 32}))
    info = DiffusionEngine(model=str(folder), device="cpu", dtype="float32").model_info
    assert (info.video.frames, info.video.fps, info.defaults.height, info.default_size[2]) == (9, 8, 32, 9)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"num_frames": 8}))
    with pytest.raises(ValueError, match="num_frames - 1 must be a multiple of 4, got 8"):
        DiffusionEngine(model=str(folder), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="fps: StableDiffusionPipeline makes images"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", default_params={"fps": 16})
    with pytest.raises(ValueError, match=r"fps must be a number in \[0.001, 240\]"):
        DiffusionEngine(model=str(folder), device="cpu", dtype="float32", default_params={"fps": 0})


def test_a_two_expert_models_second_scale_has_a_default(tmp_path_factory):
    """guidance_scale_2 as a default (Wan 2.2 A14B's card: 4.0 high-noise, 3.0 low-noise): a request naming neither
    scale gets both defaults, the same video as naming them; one naming guidance_scale alone gets it for both
    experts, as the pipeline's fallback does; /v1/models tells the second scale."""
    assert known_defaults("Wan-AI/Wan2.2-T2V-A14B-Diffusers")["guidance_scale_2"] == 3.0
    assert known_defaults("wan2.2-t2v-a14b") == known_defaults("Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    path = _saved(tmp_path_factory, "tiny-wan-a14b-defaults", tiny_wan_pipeline(two_experts=True))
    small = {"num_inference_steps": 4, "height": 16, "width": 16, "num_frames": 5}
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32",
                             default_params={**small, "guidance_scale": 4.0, "guidance_scale_2": 3.0})
    info = engine.model_info
    assert (info.defaults.guidance, info.defaults.guidance_2) == (4.0, 3.0)
    facts = model_facts(info, 4096, engine.valid_samplers())
    assert (facts["guidance_scale"], facts["guidance_scale_2"], facts["boundary_timestep"]) == (4.0, 3.0, 875.0)
    resolved = {name: SamplingParams(**given).resolve(info, engine.config)
                for name, given in {"none": {}, "first": {"guidance_scale": 5.0},
                                    "second": {"guidance_scale_2": 2.0}}.items()}
    assert (resolved["none"].guidance_scale, resolved["none"].guidance_scale_2) == (4.0, 3.0)
    assert (resolved["first"].guidance_scale, resolved["first"].guidance_scale_2) == (5.0, 5.0)
    assert (resolved["second"].guidance_scale, resolved["second"].guidance_scale_2) == (4.0, 2.0)
    plain, named, equal = (SamplingParams(seed=3, output_type="latent", **extra)
                           for extra in ({}, {"guidance_scale": 4.0, "guidance_scale_2": 3.0},
                                         {"guidance_scale": 4.0, "guidance_scale_2": 4.0}))
    outs = engine.generate(["a red circle"] * 3, [plain, named, equal], use_tqdm=False)
    assert all(out.error is None for out in outs)
    np.testing.assert_array_equal(outs[0].images[0], outs[1].images[0])
    assert float((outs[0].images[0] - outs[2].images[0]).abs().max()) > 1e-3  # the default 3.0 ran, not 4.0


def test_a_second_scale_default_is_refused_for_one_expert(wan_path, tmp_path):
    """As the request field is: a one-denoiser model takes no guidance_scale_2, from the engine or a folder."""
    with pytest.raises(ValueError, match=r"default_params: guidance_scale_2: this model \(WanPipeline\) has one "
                                         "denoiser"):
        DiffusionEngine(model=wan_path, device="cpu", dtype="float32", default_params={"guidance_scale_2": 3.0})
    folder = tmp_path / "wan"
    shutil.copytree(wan_path, folder)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"guidance_scale_2": 3.0}))
    with pytest.raises(ValueError, match="dvllm_defaults.json: guidance_scale_2: this model"):
        DiffusionEngine(model=str(folder), device="cpu", dtype="float32")
