"""Find a model (preset, local folder, Hub id) and build its pipeline, with real or dummy weights.

`load_format="dummy"` builds every component from its config with seeded random
weights, as vLLM's `--load-format dummy` does; presets are configs only, so they
always load that way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from dvllm.logging_setup import STARTUP_LOGGER
from dvllm.models.attention_backend import set_attention_backend
from dvllm.models.base import ModelAdapter
from dvllm.models.byte_tokenizer import (
    allow_qwen_vl_processor_without_torchvision,
    byte_clip_tokenizer,
    byte_qwen_tokenizer,
    byte_qwen_vl_processor,
    byte_t5_tokenizer,
)
from dvllm.models.load_config import LoadConfig
from dvllm.models.model_defaults import known_defaults
from dvllm.models.model_files import check_path_kind
from dvllm.models.model_names import (
    DEFAULT_MODEL,
    OFFLINE_HINT,
    builtin_folder,
    load_preset,
    looks_like_path,
    preset_names,
)
from dvllm.models.quantization import finish_quantization, pipeline_config
from dvllm.models.registry import adapter_for
from dvllm.models.single_file import (
    check_single_file,
    header_shapes,
    inferred_config_repo,
    is_single_file,
    is_whole_checkpoint,
    load_single_file,
    load_vae,
)
from dvllm.param_defaults import DEFAULTS_FIELDS, DEFAULTS_FILE, VIDEO_FIELDS, parse_defaults, read_defaults_file

logger = logging.getLogger(__name__)
startup = logging.getLogger(STARTUP_LOGGER)  # shown by the CLI at its default levels


@dataclass
class ModelSource:
    name: str                  # what the model is called in outputs and /v1/models
    model_index: dict[str, Any]
    folder: str | None = None  # a local diffusers folder (for a Hub id: its configs, fetched)
    hub_id: str | None = None
    preset: dict[str, Any] | None = None
    single_file: str | None = None  # its weights' one file (single_file.py); its configs are folder's

    @property
    def pipeline_class(self) -> str:
        return self.model_index["_class_name"]


def resolve_model(model: str | None, load: LoadConfig | None = None) -> ModelSource:
    """A preset, a local folder with model_index.json, or a Hub id (its configs fetched as `load` says);
    ValueError naming the path otherwise."""
    model = model or DEFAULT_MODEL
    builtin = builtin_folder(model)
    if builtin is not None:
        source = resolve_model(builtin)
        source.name = model
        return source
    if model in preset_names():
        preset = load_preset(model)
        return ModelSource(name=model, model_index=preset["model_index"], preset=preset)
    check_path_kind("model", model)  # a FIFO or a device: refused, never read
    path = os.path.expanduser(model)
    if is_single_file(path):
        return _single_file_source(model, load or LoadConfig())
    if load is not None and load.base_model:
        raise ValueError(f"base_model names the pipeline of a single-file checkpoint; {model!r} is not one "
                         f"(a .safetensors or .gguf file)")
    if os.path.isdir(path):
        index = os.path.join(path, "model_index.json")
        if not os.path.isfile(index):
            raise ValueError(f"model folder {path!r} is not a diffusers pipeline folder: it has no model_index.json")
        try:
            with open(index) as f:
                model_index = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {index}: {e}") from None
        if not isinstance(model_index, dict) or not isinstance(model_index.get("_class_name"), str):
            raise ValueError(f"{index} names no pipeline class ('_class_name')")
        return ModelSource(name=model.rstrip("/"), model_index=model_index, folder=path)
    if os.path.exists(path) or looks_like_path(model):
        raise ValueError(f"model path {path!r} does not exist or is not a diffusers folder")
    return _from_hub(model, load or LoadConfig())


def _single_file_source(model: str, load: LoadConfig) -> ModelSource:
    """A single file's source: the configs of `load.base_model`, or for a whole Stable Diffusion checkpoint
    without one, those of the diffusers repo of its kind."""
    path = os.path.expanduser(model)
    check_single_file(path)
    shapes = header_shapes(path)
    if load.base_model:
        base = resolve_model(load.base_model, dataclasses.replace(load, base_model=None))
        if base.preset is not None:
            raise ValueError(f"base_model {load.base_model!r} is a preset (configs without weights): name a "
                             "diffusers folder or Hub id")
    elif is_whole_checkpoint(shapes):
        # (the configs at the repo's main: a revision or variant names the file's own, which has none)
        base = _from_hub(inferred_config_repo(path, shapes), dataclasses.replace(load, revision=None, variant=None))
    else:
        raise ValueError(f"{path} holds one model's weights (a transformer or UNet), not a whole pipeline: name "
                         "the pipeline it belongs to with base_model (--base-model: a diffusers folder or Hub id)")
    return dataclasses.replace(base, name=model, single_file=path)


def _from_hub(repo_id: str, load: LoadConfig) -> ModelSource:
    from huggingface_hub import snapshot_download

    try:  # the configs and tokenizers only: the weights come with from_pretrained, of the variant asked for
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "*.model"], **load.hub_kwargs())
    except Exception as e:  # no network, unknown repo, gated repo...
        raise ValueError(
            f"model {repo_id!r} is not a preset ({preset_names()}), not a local folder, and could not be "
            f"fetched from the Hugging Face Hub: {type(e).__name__}: {e}; {OFFLINE_HINT}"
        ) from e
    source = resolve_model(folder)
    source.name = source.hub_id = repo_id
    return source


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device, adapter_cls: type[ModelAdapter] | None = None) -> torch.dtype:
    """A dtype name; "auto" is float32 on the CPU and, on a GPU, the family's half precision (float16
    where no family is given)."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if adapter_cls is None else adapter_cls.half_dtype


def load_adapter(model: str | None, load_format: str, device: torch.device, dtype: torch.dtype | str,
                 seed: int = 0, default_params: Any = None, load: LoadConfig | None = None) -> ModelAdapter:
    """The model's adapter on `device`, in `dtype` (a torch dtype or a name: "auto" resolved for its family),
    with its request defaults (model_defaults.py; `default_params`: the engine's, over the model's), its files
    found as `load` says (revision, variant, cache, offline)."""
    load = load or LoadConfig()
    start = time.perf_counter()
    startup.info("loading model %s on %s ...", model or DEFAULT_MODEL, device)
    source = resolve_model(model, load)
    defaults = _default_layers(source, default_params)  # a bad defaults file is named before the weights load
    adapter_cls = adapter_for(source.pipeline_class)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device, adapter_cls)
        logger.info("dtype %s on %s for %s (%s)", str(dtype).removeprefix("torch."), device.type, source.name,
                    adapter_cls.__name__)
    pipeline_cls = getattr(importlib.import_module("diffusers"), source.pipeline_class)
    adapter_cls.before_loading()
    if load_format == "dummy" or source.preset is not None:
        on = build_devices(device, load.encoder_device)
        pipeline = pipeline_cls(**dummy_components(source, adapter_cls, seed, build_on=on, dtype=dtype))
    else:
        pipeline = _load_weights(source, pipeline_cls, adapter_cls, dtype, load)
    # Dummy components are built in float32; cast only when asked for another dtype.
    pipeline.to(device=device, **({"dtype": dtype} if pipeline.dtype != dtype else {}))
    if load.quantization is not None:  # built (dummy) or passed-in components quantized now, and all checked
        finish_quantization(pipeline, load.quantization, source.model_index)
    pipeline.set_progress_bar_config(disable=True)
    set_attention_backend(pipeline, load.attention_backend)
    if load.vae_tiling:
        pipeline.vae.enable_tiling()
    if load.vae_tile_size is not None:
        set_tile_size(pipeline.vae, load.vae_tile_size)
    adapter = adapter_cls(pipeline, source.name, device, dtype)
    if load.vae_dtype != "auto":  # over the adapter's own choice (SDXL's force_upcast)
        adapter.place_vae(DTYPES[load.vae_dtype])
    if load.encoder_device and torch.device(load.encoder_device) != device:
        adapter.place_text_encoders(torch.device(load.encoder_device))
    _apply_defaults(adapter, source, defaults)
    startup.info("model %s loaded in %.1f s", source.name, time.perf_counter() - start)
    return adapter


def _load_weights(source: ModelSource, pipeline_cls: type, adapter_cls: type[ModelAdapter], dtype: torch.dtype,
                  load: LoadConfig) -> Any:
    """The pipeline with its real weights: a diffusers folder or Hub id, or a single file with its base model's
    configs (single_file.py); `load.vae` in place of the model's own VAE."""
    hub = load.hub_kwargs() if source.hub_id else {}
    components = _absent_components(source, pipeline_cls) | adapter_cls.load_kwargs
    if load.vae:
        components["vae"] = load_vae(load.vae, source.model_index, source.folder, dtype, load.hub_kwargs())

    def from_pretrained(**passed: Any) -> Any:
        quantized = {"quantization_config": pipeline_config(load.quantization, source.model_index)} \
            if load.quantization is not None else {}
        return pipeline_cls.from_pretrained(source.hub_id or source.folder, dtype=dtype, variant=load.variant,
                                            **hub, **quantized, **(components | passed))

    try:
        if source.single_file:
            return load_single_file(source.single_file, source.folder, source.model_index, pipeline_cls, dtype,
                                    components, from_pretrained)
        return from_pretrained()
    except OSError as e:  # a weight file missing: offline, or another variant than the files'
        which = f"variant {load.variant!r}" if load.variant else "no variant (a repo of fp16 files only needs "\
            "variant 'fp16')"
        raise ValueError(f"cannot load the weights of {source.name} with {which}: {e}") from None


def _absent_components(source: ModelSource, pipeline_cls: type) -> dict[str, None]:
    """Components the folder saved as absent ([null, null] in model_index.json) that the pipeline does not
    list as optional: from_pretrained wants them passed as None (an SD3 without T5: text_encoder_3 and
    tokenizer_3, as diffusers documents it)."""
    optional = set(getattr(pipeline_cls, "_optional_components", []))
    return {name: None for name, spec in source.model_index.items()
            if not name.startswith("_") and spec in ([None, None], (None, None)) and name not in optional}


def _default_layers(source: ModelSource, default_params: Any) -> list[tuple[dict[str, Any], str]]:
    """The model's request defaults over its pipeline's (model_defaults.py), each layer with where it comes from:
    the known table's, a preset's own (model_names.load_preset), its folder's dvllm_defaults.json, then the engine's
    default_params."""
    layers = [(known_defaults(source.hub_id or source.name), f"dvllm's defaults for {source.name}")]
    if source.preset is not None and "defaults" in source.preset:
        where = f"preset {source.name}'s defaults"
        layers.append((parse_defaults(source.preset["defaults"], where), where))
    path = os.path.join(source.folder, DEFAULTS_FILE) if source.folder else None
    if path and os.path.isfile(path):
        layers.append((read_defaults_file(path), path))
    if default_params is not None:
        layers.append((parse_defaults(default_params, "default_params"), "default_params"))
    return layers


def _apply_defaults(adapter: ModelAdapter, source: ModelSource, layers: list[tuple[dict[str, Any], str]]) -> None:
    """The layers of defaults (_default_layers) applied, each over the one before. "max_sequence_length" sets the
    text length of a model whose pipeline pads its text to that length with zeros (stable-diffusion-3 without T5):
    it changes the model's conditions, so it is applied first, before the adapter's info (which reads it) is
    computed."""
    defaults: dict[str, Any] = {}
    where: dict[str, str] = {}
    for layer, origin in layers:
        defaults.update(layer)
        where.update(dict.fromkeys(layer, origin))
    if "max_sequence_length" in defaults:
        setter = getattr(adapter, "set_max_sequence_length", None)
        if setter is None:
            raise ValueError(f"{where['max_sequence_length']}: max_sequence_length: the {adapter.info.family} "
                             "family takes no per-model text length (only stable-diffusion-3 models without a T5 "
                             "encoder do)")
        setter(defaults["max_sequence_length"], source=f"{where['max_sequence_length']}: max_sequence_length")
    if "guidance_scale_2" in defaults and adapter.info.expert_boundary is None:
        raise ValueError(f"{where['guidance_scale_2']}: guidance_scale_2: this model ({adapter.info.pipeline_class}) "
                         "has one denoiser; the scale of a second expert is for two-expert models (Wan 2.2 A14B)")
    if defaults:
        info = adapter.info
        chosen = {DEFAULTS_FIELDS[k]: v for k, v in defaults.items() if k in DEFAULTS_FIELDS}
        adapter.info = adapter.follow_defaults(dataclasses.replace(
            info, defaults=dataclasses.replace(info.defaults, **chosen), video=_video_defaults(info, defaults, where)))
        logger.info("request defaults for %s: %s", source.name,
                    ", ".join(f"{k}={v} ({where[k]})" for k, v in sorted(defaults.items())))


def build_devices(device: torch.device, encoder_device: str | None) -> Callable[[str], torch.device] | None:
    """Where a GPU engine builds each dummy component (None: on the CPU, as for a CPU engine): on its GPU, where
    initializing billions of weights takes seconds instead of minutes of the CPU's serial random numbers; the
    text encoders where they will run."""
    if device.type != "cuda":
        return None
    encoders = torch.device(encoder_device) if encoder_device else device
    return lambda name: encoders if name.startswith("text_encoder") else device


def _video_defaults(info: Any, defaults: dict[str, Any], where: dict[str, str]) -> Any:
    """The model's ModelInfo.video with the defaults' num_frames and fps; ValueError for an image model or a
    frame count the VAE cannot pack."""
    chosen = {VIDEO_FIELDS[k]: v for k, v in defaults.items() if k in VIDEO_FIELDS}
    if not chosen:
        return info.video
    key = next(k for k in VIDEO_FIELDS if k in defaults)
    if info.video is None:
        raise ValueError(f"{where[key]}: {key}: {info.pipeline_class} makes images, not videos")
    frames = chosen.get("frames", info.video.frames)
    if (frames - 1) % info.video.frame_multiple:
        raise ValueError(f"{where['num_frames']}: num_frames - 1 must be a multiple of "
                         f"{info.video.frame_multiple}, got {frames}")
    if info.video.max_frames is not None and frames > info.video.max_frames:
        raise ValueError(f"{where['num_frames']}: num_frames must be at most {info.video.max_frames} for this model "
                         f"(its position tables), got {frames}")
    return dataclasses.replace(info.video, **chosen)


def dummy_components(source: ModelSource, adapter_cls: type[ModelAdapter], seed: int, meta: bool = False,
                     build_on: Callable[[str], torch.device] | None = None,
                     dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Every component from its config, with seeded random weights (meta: the models on the meta device,
    no weights at all; tokenizers and schedulers as usual). `build_on` names the device for each model: on a GPU
    it is built in float32 and cast to `dtype` there where that fits (_gpu_if_it_fits), else on the CPU."""
    components: dict[str, Any] = {}
    for name, spec in source.model_index.items():
        if name.startswith("_"):
            continue
        if not isinstance(spec, list):  # a pipeline setting, e.g. force_zeros_for_empty_prompt
            components[name] = adapter_cls.load_kwargs.get(name, spec)
            continue
        library, class_name = spec
        if library is None or adapter_cls.load_kwargs.get(name, "") is None:
            components[name] = None
            continue
        cls = getattr(importlib.import_module(library), class_name)
        is_model = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
        place = torch.device("meta") if meta and is_model else None
        if build_on is not None and is_model and not meta:
            place = _gpu_if_it_fits(build_on(name), cls, name, source, dtype)
        gpus = [place] if place is not None and place.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus), (place if place is not None else contextlib.nullcontext()):
            # each component's own reproducible weights: no two components share a stream
            torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            components[name] = _build_component(cls, name, source)
        if gpus and dtype is not None:
            components[name].to(dtype)  # what pipeline.to does next, before the next component takes memory
        if isinstance(components[name], torch.nn.Module):  # as from_pretrained leaves it: no dropout (T5 has 0.1)
            components[name].eval()
    for name, value in adapter_cls.load_kwargs.items():
        components.setdefault(name, value)
    return components


def _gpu_if_it_fits(device: torch.device, cls: type, name: str, source: ModelSource,
                    dtype: torch.dtype | None) -> torch.device | None:
    """`device` if it is a GPU on which the model in float32 and its cast copy take at most 60% of the memory,
    else None (the CPU). The rule reads the GPU's size, not what is free, so that a group's members and a
    benchmark's baseline build the same weights as the engine (one seed gives other numbers on a GPU)."""
    if device.type != "cuda":
        return None
    with torch.device("meta"):
        numel = sum(p.numel() for p in _build_component(cls, name, source).parameters())
    final = torch.empty((), dtype=dtype or torch.float32).element_size()
    return device if numel * (4 + final) <= 0.6 * torch.cuda.get_device_properties(device).total_memory else None


def _build_component(cls: type, name: str, source: ModelSource) -> Any:
    if source.preset is not None:
        config = source.preset["components"][name]
        kind = config.get("byte_level")
        if kind == "t5":
            return byte_t5_tokenizer(config["model_max_length"])
        if kind == "qwen":
            return byte_qwen_tokenizer(config["model_max_length"])
        if kind == "qwen-vl":  # a Qwen2VLProcessor: that tokenizer with the vision tokens, and an image processor
            settings = {key: value for key, value in config.items() if key not in ("byte_level", "image_processor")}
            return byte_qwen_vl_processor(**settings, **config.get("image_processor", {}))
        if kind:  # "clip" (or true, as older presets say)
            return byte_clip_tokenizer(config["model_max_length"], config.get("pad_token", "<|endoftext|>"))
        if hasattr(cls, "from_config"):  # diffusers models and schedulers
            return cls.from_config(config)
        return cls(cls.config_class(**config))  # transformers models
    subfolder = os.path.join(source.folder, name)
    if hasattr(cls, "from_config"):
        return cls.from_config(cls.load_config(subfolder))
    if issubclass(cls, PreTrainedModel):
        return cls(cls.config_class.from_pretrained(subfolder))
    allow_qwen_vl_processor_without_torchvision()  # a Qwen2VLProcessor loads only with it where torchvision is missing
    return cls.from_pretrained(subfolder)  # tokenizers, feature extractors: small files, no weights


def set_tile_size(vae: Any, pixels: int) -> None:
    """The VAE's tiles `pixels` on a side (their latents that over its scale factor), overlapping by a quarter;
    ValueError for a side the factor does not divide or a VAE that tiles otherwise."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    if isinstance(vae, AutoencoderKLWan):  # its stride is set apart: a quarter's overlap, in whole latents
        factor = vae.spatial_compression_ratio
        _check_tile_side(pixels, factor)
        stride = pixels - max(factor, pixels // 4 // factor * factor)
        vae.tile_sample_min_height = vae.tile_sample_min_width = pixels
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = stride
        return
    if not isinstance(vae, AutoencoderKL):
        raise ValueError(f"vae_tile_size: {type(vae).__name__} tiles its own way; the size is set for "
                         "AutoencoderKL's VAEs (SD, SDXL, SD3, Flux, Z-Image) and Wan's")
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    _check_tile_side(pixels, factor)
    vae.tile_sample_min_size, vae.tile_latent_min_size = pixels, pixels // factor


def _check_tile_side(pixels: int, factor: int) -> None:
    if pixels % factor or pixels < 2 * factor:
        raise ValueError(f"vae_tile_size must be a multiple of the VAE's scale factor {factor}, at least "
                         f"{2 * factor}; got {pixels}")
