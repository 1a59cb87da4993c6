"""Model resolution and loading (dvllm/models/loader.py) and engine-argument checks. No network:
Hub look-ups are replaced by a stub, and only the tiny pipelines are ever built."""
from __future__ import annotations

import json
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch

import dvllm.engine.engine as engine_module
from dvllm import DiffusionEngine, EngineConfig
from dvllm.engine.start_checks import check_at_start
from dvllm.models.loader import (DEFAULT_MODEL, builtin_folder, load_adapter, load_preset, preset_names,
                                 resolve_model)

CPU = torch.device("cpu")


@pytest.fixture
def no_loading(monkeypatch):
    """Makes any attempt to build a worker fail the test: argument errors must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the engine started loading a model before rejecting its arguments")

    monkeypatch.setattr(engine_module, "create_executor", refuse)


def write_model_index(folder: Path, index: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# -- paths that are not models ---------------------------------------------------------------

def test_missing_absolute_path_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist") as err:
        resolve_model(str(missing))
    assert str(missing) in str(err.value)
    # Through the engine too: the same error, not a Hub look-up or a traceback from diffusers.
    with pytest.raises(ValueError) as err:
        DiffusionEngine(model=str(missing), device="cpu")
    assert str(missing) in str(err.value)


def test_missing_relative_path_names_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "./does/not/exist" surely does not exist
    with pytest.raises(ValueError) as err:
        DiffusionEngine(model="./does/not/exist", device="cpu")
    assert "./does/not/exist" in str(err.value)


def test_a_file_is_not_a_model(tmp_path):
    some_file = tmp_path / "model_index.json"
    some_file.write_text("{}")
    with pytest.raises(ValueError) as err:
        resolve_model(str(some_file))
    assert str(some_file) in str(err.value)


def test_folder_without_model_index_is_not_a_diffusers_folder(tmp_path):
    folder = tmp_path / "just-a-folder"
    folder.mkdir()
    (folder / "unet").mkdir()  # looks a bit like a model, but has no model_index.json
    with pytest.raises(ValueError) as err:
        DiffusionEngine(model=str(folder), device="cpu")
    message = str(err.value)
    assert str(folder) in message
    assert "not a diffusers" in message and "model_index.json" in message


def test_unsupported_pipeline_class_lists_the_supported_ones(tmp_path):
    folder = write_model_index(tmp_path / "cogvideox", {"_class_name": "CogVideoXPipeline",
                                                        "transformer": ["diffusers", "CogVideoXTransformer3DModel"]})
    with pytest.raises(ValueError) as err:
        DiffusionEngine(model=str(folder), device="cpu")
    message = str(err.value)
    assert "CogVideoXPipeline" in message and "StableDiffusionPipeline" in message and "WanPipeline" in message


def test_model_index_without_class_name_is_a_value_error(tmp_path):
    folder = write_model_index(tmp_path / "no-class", {"unet": ["diffusers", "UNet2DConditionModel"]})
    with pytest.raises(ValueError, match="_class_name"):
        DiffusionEngine(model=str(folder), device="cpu")


# -- Hub ids (stubbed: no network) -------------------------------------------------------------

def test_hub_failure_becomes_a_value_error_naming_the_repo(monkeypatch):
    def offline(repo_id: str, **kwargs):
        raise ConnectionError("no network in tests")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError) as err:
        resolve_model("some-org/no-such-model")
    message = str(err.value)
    assert "some-org/no-such-model" in message and "ConnectionError" in message
    assert "tiny-sd" in message  # points the user at the presets


def test_hub_id_is_resolved_through_its_fetched_configs(monkeypatch, sd_eps_path):
    fetched: list[str] = []

    def fake_snapshot(repo_id: str, **kwargs) -> str:
        fetched.append(repo_id)
        return sd_eps_path

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    source = resolve_model("some-org/tiny-sd")
    assert fetched == ["some-org/tiny-sd"]
    assert (source.name, source.hub_id, source.folder) == ("some-org/tiny-sd", "some-org/tiny-sd", sd_eps_path)
    assert source.pipeline_class == "StableDiffusionPipeline"


# -- presets ---------------------------------------------------------------------------------

def test_preset_names():
    names = preset_names()
    assert {"tiny-sd", "sd15", "sd-2.1", "sd-turbo"} <= set(names)
    assert builtin_folder(DEFAULT_MODEL) is not None  # the default ships with weights


@pytest.mark.parametrize("name", ["tiny-sd", "sd15", "sd-2.1", "sd-turbo"])
def test_preset_configs_parse_and_fit_together(name):
    # Only the JSON is read: building sd15 / sd-2.1 would take GBs and minutes.
    preset = load_preset(name)
    index, components = preset["model_index"], preset["components"]
    assert index["_class_name"] == "StableDiffusionPipeline"
    needed = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None}
    assert needed <= set(components), f"{name}: no config for {sorted(needed - set(components))}"
    # The UNet attends to the text encoder's hidden states, so these must agree.
    assert components["unet"]["cross_attention_dim"] == components["text_encoder"]["hidden_size"]
    assert resolve_model(name).preset == preset


def test_engine_without_model_loads_the_trained_tiny_shapes():
    engine = DiffusionEngine(device="cpu")
    assert engine.config.model is None
    info, loaded = engine.model_info, engine.loaded_model
    assert (loaded.name, loaded.device, loaded.dtype, loaded.vae_dtype) == ("tiny-shapes", "cpu", "float32", "float32")
    assert loaded.quantization is None
    assert info.pipeline_class == "StableDiffusionPipeline"
    # its dvllm_defaults.json: what it was trained for, not the pipeline's generic 50 steps at 512 px
    assert (info.defaults.height, info.defaults.width, info.defaults.steps, info.defaults.guidance) == (64, 64, 25, 1.5)


def test_a_folders_dvllm_defaults_must_be_known_keys(sd_eps_path, tmp_path):
    import shutil

    folder = tmp_path / "with-defaults"
    shutil.copytree(sd_eps_path, folder)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"num_inference_steps": 7, "height": 24}))
    info = DiffusionEngine(model=str(folder), device="cpu", dtype="float32").model_info
    assert (info.defaults.steps, info.defaults.height) == (7, 24)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"steps": 7}))
    with pytest.raises(ValueError, match="unknown keys"):
        DiffusionEngine(model=str(folder), device="cpu", dtype="float32")


# -- load_format="dummy" ---------------------------------------------------------------------

def unet_weights(path: str, load_format: str, seed: int = 0) -> dict[str, torch.Tensor]:
    adapter = load_adapter(path, load_format, CPU, torch.float32, seed=seed)
    return adapter.pipeline.unet.state_dict()


def random_init(weights: dict[str, torch.Tensor]) -> list[str]:
    """Conv and linear weights: randomly initialised (norm scales and biases start as constants)."""
    return [k for k, v in weights.items() if k.endswith("weight") and v.ndim >= 2]


@pytest.fixture(scope="module")
def real_and_dummy(sd_eps_path):
    return unet_weights(sd_eps_path, "auto"), unet_weights(sd_eps_path, "dummy", seed=0)


def test_dummy_load_builds_the_same_architecture_with_other_weights(real_and_dummy):
    real, dummy = real_and_dummy
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    assert all(v.dtype == torch.float32 for v in dummy.values())
    keys = random_init(real)
    assert len(keys) > 10
    same = [k for k in keys if torch.equal(real[k], dummy[k])]
    assert not same, f"dummy weights equal the saved ones for {same}"


def test_dummy_weights_follow_the_seed(sd_eps_path, real_and_dummy):
    _, seed0 = real_and_dummy
    again = unet_weights(sd_eps_path, "dummy", seed=0)
    assert seed0.keys() == again.keys()
    for k in seed0:
        torch.testing.assert_close(again[k], seed0[k], rtol=0, atol=0, msg=f"seed 0 not reproducible at {k}")
    seed1 = unet_weights(sd_eps_path, "dummy", seed=1)
    same = [k for k in random_init(seed0) if torch.equal(seed0[k], seed1[k])]
    assert not same, f"seeds 0 and 1 gave equal weights for {same}"


def test_dummy_models_are_in_eval_mode_so_a_text_encodes_the_same_each_time():
    """As from_pretrained leaves them: flux-cpu's T5 has dropout 0.1, which in training mode made every encode of
    the same text (and so every dummy-weight image) differ."""
    pipeline = load_adapter("flux-cpu", "dummy", torch.device("cpu"), torch.float32).pipeline
    modules = [m for m in pipeline.components.values() if isinstance(m, torch.nn.Module)]
    assert modules and not any(m.training for module in modules for m in module.modules())
    with torch.inference_mode():
        first, again = (pipeline.encode_prompt("a lighthouse", "a lighthouse", device="cpu")[0] for _ in range(2))
    torch.testing.assert_close(first, again, rtol=0, atol=0)


def test_dummy_load_keeps_the_real_scheduler_and_tokenizer(sd_eps_path):
    # Only weights are random: configs and tokenizer files still come from the folder.
    real = load_adapter(sd_eps_path, "auto", CPU, torch.float32)
    dummy = load_adapter(sd_eps_path, "dummy", CPU, torch.float32, seed=3)
    assert dummy.info == real.info
    assert dummy.pipeline.scheduler.config == real.pipeline.scheduler.config
    assert dummy.pipeline.tokenizer("a red circle")["input_ids"] == real.pipeline.tokenizer("a red circle")["input_ids"]


# -- engine arguments ------------------------------------------------------------------------

def test_unknown_engine_argument_is_named(no_loading):
    with pytest.raises(ValueError, match="bogus_arg"):
        DiffusionEngine(bogus_arg=1)


@pytest.mark.parametrize("field,value", [
    ("dtype", "float64"),
    ("device", "tpu"),
    ("device", "cuda:"),
    ("max_batch_size", 0),
    ("max_batch_size", True),
    ("scheduling_policy", "lifo"),
    ("load_format", "safetensors"),
    ("executor", "mp"),
    ("num_workers", 0),
    ("worker_num_gpus", -1),
    ("worker_num_cpus", "2"),
    ("max_worker_restarts", -1),
    ("ray_startup_timeout_s", 0),
])
def test_bad_engine_config_value_names_the_field(no_loading, field, value):
    with pytest.raises(ValueError, match=field) as err:  # by EngineConfig, or by the package that owns the field
        check_at_start(EngineConfig(**{field: value}))
    assert repr(value) in str(err.value)
    with pytest.raises(ValueError, match=field):
        DiffusionEngine(**{field: value})


@pytest.mark.parametrize("kwargs,message", [
    ({"num_workers": 2}, "num_workers=2 needs executor='ray'"),
    ({"ray_address": "auto"}, "ray_address is set but executor is not 'ray'"),
])
def test_ray_settings_need_the_ray_executor(no_loading, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DiffusionEngine(**kwargs)


def test_unreadable_model_index_names_the_file(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model_index.json"):
        DiffusionEngine(model=str(folder), device="cpu")


# Published parameter counts of the real models the presets mirror (approximate, in millions).
PRESET_SIZES = {
    "sd15": {"unet": 860, "vae": 83.7, "text_encoder": 123},
    "sd-2.1": {"unet": 866, "vae": 83.7, "text_encoder": 340},
    "sd-turbo": {"unet": 866, "vae": 83.7, "text_encoder": 340},
    "sdxl": {"unet": 2567, "vae": 83.7, "text_encoder": 123, "text_encoder_2": 695},
    "sd3-medium": {"transformer": 2028, "vae": 83.8, "text_encoder": 124, "text_encoder_2": 695,
                   "text_encoder_3": 4762},
    "flux-dev": {"transformer": 11901, "vae": 83.8, "text_encoder": 123, "text_encoder_2": 4762},
    "qwen-image": {"transformer": 20430, "vae": 126.9, "text_encoder": 8292},
    "z-image-turbo": {"transformer": 6155, "vae": 83.8, "text_encoder": 4022},
}


@pytest.mark.parametrize("name", sorted(PRESET_SIZES))
def test_presets_build_the_published_architectures(name):
    """Each preset component instantiates at full size on the meta device (no memory) with the
    published parameter count, so the GPU suite times the real architectures."""
    import importlib

    preset = load_preset(name)
    for component, millions in PRESET_SIZES[name].items():
        library, class_name = preset["model_index"][component]
        cls = getattr(importlib.import_module(library), class_name)
        config = preset["components"][component]
        with torch.device("meta"):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(cls.config_class(**config))
        count = sum(p.numel() for p in model.parameters()) / 1e6
        assert count == pytest.approx(millions, rel=0.01), f"{name}/{component}: {count:.1f}M parameters"


@pytest.mark.parametrize("pipeline_class, expected", [
    ("StableDiffusionPipeline", torch.float16), ("StableDiffusionXLPipeline", torch.float16),
    ("StableDiffusionXLInpaintPipeline", torch.float16),
    ("FluxPipeline", torch.bfloat16), ("FluxKontextPipeline", torch.bfloat16),
    ("StableDiffusion3Pipeline", torch.bfloat16), ("QwenImagePipeline", torch.bfloat16),
    ("QwenImageEditPipeline", torch.bfloat16), ("ZImagePipeline", torch.bfloat16),
])
def test_auto_dtype_is_each_familys_half_precision_on_a_gpu(pipeline_class, expected):
    """Flux overflows in float16: the DiT families' pipelines document bfloat16, the UNets float16. On the CPU,
    auto is float32 for every family; a named dtype is taken as named."""
    from dvllm.models.loader import resolve_dtype
    from dvllm.models.registry import adapter_for

    adapter_cls = adapter_for(pipeline_class)
    assert resolve_dtype("auto", torch.device("cuda"), adapter_cls) == expected
    assert resolve_dtype("auto", torch.device("cpu"), adapter_cls) == torch.float32
    assert resolve_dtype("float16", torch.device("cuda"), adapter_cls) == torch.float16


def test_auto_dtype_is_resolved_at_load_and_logged(sd3_path, caplog):
    with caplog.at_level("INFO", logger="dvllm.models.loader"):
        adapter = load_adapter(sd3_path, "auto", torch.device("cpu"), "auto")
    assert adapter.dtype == torch.float32 and adapter.pipeline.transformer.dtype == torch.float32
    assert "dtype float32 on cpu" in caplog.text and "StableDiffusion3Adapter" in caplog.text


def test_a_gpu_engine_builds_dummy_models_on_its_gpu_where_they_fit(monkeypatch):
    """On a GPU the dummy weights are drawn there (the CPU draws random numbers serially: minutes for a 5B text
    encoder); a model whose float32 build and cast copy pass 60% of the GPU's size is built on the CPU, and the
    text encoders go where --encoder-device puts them. The rule reads the GPU's size, not its free memory, so a
    group's members build what the leader builds."""
    from types import SimpleNamespace

    from dvllm.models import loader

    source = loader.resolve_model("flux-cpu")
    cls = getattr(__import__("diffusers"), "FluxTransformer2DModel")
    with torch.device("meta"):
        numel = sum(p.numel() for p in loader._build_component(cls, "transformer", source).parameters())
    gpu = torch.device("cuda:0")
    for total, want in ((numel * 6 / 0.6, gpu), (numel * 6 / 0.6 - 1, None)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _, total=total: SimpleNamespace(
            total_memory=total))
        assert loader._gpu_if_it_fits(gpu, cls, "transformer", source, torch.bfloat16) == want
    assert loader._gpu_if_it_fits(CPU, cls, "transformer", source, torch.bfloat16) is None
    assert loader.build_devices(CPU, None) is None
    where = loader.build_devices(gpu, "cpu")
    assert (where("text_encoder_2"), where("transformer"), where("vae")) == (CPU, gpu, gpu)
    assert loader.build_devices(gpu, None)("text_encoder") == gpu
