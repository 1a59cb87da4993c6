"""ModelInfo as capability specs: what each spec answers, that a family's info crosses processes, and that a new
family fills in only the specs it has (text-to-image needs no image or guidance spec)."""
import pickle

import pytest

from dvllm import DiffusionEngine
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text


def _plain_family() -> ModelInfo:
    return ModelInfo(family="new", pipeline_class="NewPipeline",
                     defaults=Defaults(steps=20, guidance=5.0, height=64, width=48),
                     schedule=Schedule({"_class_name": "EulerDiscreteScheduler"}),
                     latents=Latents(channels=4, scale=8, size_factor=8),
                     text=Text({"prompt_embeds": (7, 16), "pooled": (16,)}))


def test_a_new_family_fills_in_the_specs_it_has():
    info = _plain_family()
    assert info.images == ImageInputs() and not info.images.img2img  # text-to-image only
    assert info.guidance.uses_cfg(5.0) and not info.guidance.uses_cfg(1.0)  # diffusers' rule: above 1
    assert info.latents.shape(64, 48) == (4, 8, 6) and info.latents.numel(64, 48) == 192
    assert info.text.condition_numel == 7 * 16 + 16
    assert info.input_numel(64, 48, None, inpaint=False) == 0 and info.input_grids(None) == ()


@pytest.mark.parametrize("guidance, scale, negative, expected", [
    (Guidance(supported=False), 7.0, "x", False),  # embedded guidance (Flux, LCM): never extra rows
    (Guidance(needs_negative_prompt=True), 4.0, None, False),  # Qwen-Image's true CFG wants a negative prompt
    (Guidance(needs_negative_prompt=True), 4.0, "", True),
    (Guidance(threshold=0.0), 0.5, None, True),  # Z-Image: any guidance above 0
    (Guidance(threshold=0.0), 0.0, None, False),
])
def test_when_guidance_adds_rows(guidance, scale, negative, expected):
    assert guidance.uses_cfg(scale, negative) is expected


def test_packed_latents_and_inpaint_state():
    packed = Latents(channels=16, scale=8, size_factor=16, patch=2)
    assert packed.shape(64, 32) == (4 * 2, 16 * 4)  # 2x2 patches of an 8x4 latent image, 64 features each
    info = ModelInfo(family="x", pipeline_class="X", defaults=Defaults(1, 1.0, 64, 64), schedule=Schedule({}),
                     latents=Latents(channels=4, scale=8, size_factor=8), text=Text({}),
                     images=ImageInputs(img2img=True, inpaint_channels=5))
    assert info.input_numel(64, 32, None, inpaint=True) == 5 * 8 * 4
    assert info.most_input_numel(64, 32) == 5 * 8 * 4


def test_a_served_familys_info_crosses_processes_and_names_no_load_facts(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    info = engine.model_info
    assert pickle.loads(pickle.dumps(info)) == info  # what a Ray or process worker sends the engine
    assert not hasattr(info, "name") and not hasattr(info, "dtype")  # the loading layer's: LoadedModel
    assert engine.loaded_model.name == sd_eps_path and engine.loaded_model.dtype == "float32"
    assert info.schedule.step_kwargs == ("eta", "generator") and info.schedule.eta == 0.0
    assert info.images.img2img and info.images.inpaint_channels > 0
