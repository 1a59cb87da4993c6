"""Single-file checkpoints (what civitai and many Hub repos ship) and component overrides (`--vae`).

Two kinds of file are served, both through diffusers' own `from_single_file`:
- a whole Stable Diffusion checkpoint (SD 1.x/2.x, SDXL and its refiner, inpainting) in the original layout:
  the UNet, the VAE and the text encoders in one file. Its configs come from `base_model` (a diffusers
  folder or Hub id) or, without one, from the diffusers repo of the kind diffusers infers from its keys;
- one denoiser's weights (a Flux, SD3, Qwen-Image or Z-Image transformer, a UNet; original or diffusers key
  layout, GGUF too): `base_model` names the pipeline that supplies everything else.

Only a file's header is read to tell the two apart: the weights are read once, by diffusers.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from dvllm.models.gguf_header import read_gguf_names
from dvllm.models.model_files import check_path_kind

SUFFIXES = (".safetensors", ".sft", ".gguf")
# What an original-layout whole checkpoint holds besides its UNet: the VAE's weights
_WHOLE_CHECKPOINT_PREFIX = "first_stage_model."
_DENOISERS = ("transformer", "unet")


def is_single_file(model: str) -> bool:
    """A path to one weights file (not a folder, not a Hub id)."""
    path = os.path.expanduser(model)
    return os.path.isfile(path) and path.lower().endswith((*SUFFIXES, ".ckpt", ".pt", ".bin", ".pth"))


def check_single_file(path: str) -> None:
    """A file dvllm reads: safetensors or GGUF; pickles are refused (loading one runs its code)."""
    if not path.lower().endswith(SUFFIXES):
        raise ValueError(f"{path}: dvllm reads .safetensors and .gguf checkpoints, not pickles (.ckpt/.pt/.bin "
                         "run code when loaded); convert it to safetensors first")


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape, from the file's header only."""
    if path.lower().endswith(".gguf"):
        return {name: () for name in read_gguf_names(path)}
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # not a safetensors file, a truncated download...
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def is_whole_checkpoint(shapes: dict[str, tuple[int, ...]]) -> bool:
    return any(name.startswith(_WHOLE_CHECKPOINT_PREFIX) for name in shapes)


def inferred_config_repo(path: str, shapes: dict[str, tuple[int, ...]]) -> str:
    """The diffusers repo whose configs fit a whole checkpoint, as diffusers infers its kind from its keys and
    shapes (given here as meta tensors: nothing is read)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS, infer_diffusers_model_type

    kind = infer_diffusers_model_type({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    repo = DIFFUSERS_DEFAULT_PIPELINE_PATHS.get(kind, {})
    if "subfolder" in repo or "pretrained_model_name_or_path" not in repo:
        raise ValueError(f"{path}: diffusers reads it as a {kind!r} checkpoint, which dvllm does not serve; name "
                         "the pipeline it belongs to with --base-model")
    return repo["pretrained_model_name_or_path"]


def denoiser_name(model_index: dict[str, Any]) -> str:
    for name in _DENOISERS:
        if isinstance(model_index.get(name), list):
            return name
    raise ValueError(f"the base model's pipeline {model_index.get('_class_name')!r} has no transformer or unet")


def load_single_file(path: str, folder: str, model_index: dict[str, Any], pipeline_cls: type,
                     dtype: torch.dtype, components: dict[str, Any], from_pretrained: Any) -> Any:
    """The pipeline of `path`: a whole checkpoint with `folder`'s configs (and `components` over its own), or the
    base pipeline (`from_pretrained(**extra)` reads it, with `components`) with its denoiser from `path`."""
    if is_whole_checkpoint(header_shapes(path)):
        from diffusers.loaders.single_file_utils import SingleFileComponentError

        try:
            return pipeline_cls.from_single_file(path, config=folder, torch_dtype=dtype, local_files_only=True,
                                                 **components)
        except (OSError, KeyError, RuntimeError, ValueError, SingleFileComponentError) as e:
            raise ValueError(f"cannot read {path} as a {model_index['_class_name']} checkpoint with the configs "
                             f"of {folder}: {type(e).__name__}: {e}") from None
    name = denoiser_name(model_index)
    denoiser = load_component_file(path, model_index[name][1], folder, name, dtype)
    return from_pretrained(**{name: denoiser})


def load_component_file(path: str, class_name: str, folder: str, subfolder: str, dtype: torch.dtype) -> Any:
    """One model (a denoiser, a VAE) from a single file, its config from `folder`/`subfolder`; a GGUF file stays
    quantized, computing in `dtype`."""
    cls = getattr(importlib.import_module("diffusers"), class_name)
    if not hasattr(cls, "from_single_file"):
        raise ValueError(f"{path}: diffusers cannot read a {class_name} from a single file")
    kwargs: dict[str, Any] = {}
    if path.lower().endswith(".gguf"):
        read_gguf_names(path)  # the package is there and the file is whole, or a clear error
        from diffusers import GGUFQuantizationConfig

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    try:
        return cls.from_single_file(path, config=folder, subfolder=subfolder, torch_dtype=dtype,
                                    local_files_only=True, **kwargs)
    except (OSError, KeyError, RuntimeError, ValueError, SingleFileComponentError) as e:  # another model's weights
        raise ValueError(f"cannot read {path} as the {subfolder} ({class_name}) of {folder}: "
                         f"{type(e).__name__}: {e}") from None


def load_vae(vae: str, model_index: dict[str, Any], folder: str | None, dtype: torch.dtype,
             hub_kwargs: dict[str, Any]) -> Any:
    """`--vae`: a single file (its config from the model's own VAE), a diffusers folder (the VAE's own, or a
    pipeline's with a vae/ subfolder) or a Hub id of either."""
    spec = model_index.get("vae")
    if not isinstance(spec, list):
        raise ValueError("--vae: this pipeline has no VAE to replace")
    class_name = spec[1]
    check_path_kind("vae", vae)  # a FIFO or a device is no Hub id: refused, not looked up
    path = os.path.expanduser(vae)
    if os.path.isfile(path):
        check_single_file(path)
        if folder is None:
            raise ValueError("--vae with a single file needs the model's configs (a folder, a Hub id)")
        return load_component_file(path, class_name, folder, "vae", dtype)
    cls = getattr(importlib.import_module("diffusers"), class_name)
    subfolder = "vae" if os.path.isfile(os.path.join(path, "vae", "config.json")) else None
    try:
        return cls.from_pretrained(path if os.path.isdir(path) else vae, subfolder=subfolder, torch_dtype=dtype,
                                   **({} if os.path.isdir(path) else hub_kwargs))
    except (OSError, ValueError) as e:
        raise ValueError(f"--vae {vae!r}: not a {class_name} file, folder or Hub id that could be read: "
                         f"{type(e).__name__}: {e}") from None
