"""The model's files, checked with the engine's other settings, before anything loads (no torch here): what
kind of path `model`, `vae` and `base_model` name, a GGUF file's header and tensor table, and a model folder's
dvllm_defaults.json with default_params, against max_image_pixels. A bad file is named with what is wrong with
it in seconds, not after the core process has imported the ML stack and loaded the rest of the model."""
from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Any

from dvllm.models.model_names import is_packaged
from dvllm.param_defaults import DEFAULTS_FILE, check_default_size, read_defaults_file

if TYPE_CHECKING:
    from dvllm.config import EngineConfig

PATH_FIELDS = ("model", "vae", "base_model")


def check_path_kind(field: str, path: str | None) -> None:
    """A path that exists must be a regular file or a folder, as LoRA paths must (lora/files.py): a FIFO or a
    device (/dev/zero) is refused, not read, nor taken for a Hub id because it is no file and no folder."""
    if not path:
        return
    try:
        mode = os.stat(os.path.expanduser(path)).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # a Hub id or preset name, or a missing path, which the loader names
    except OSError as e:
        raise ValueError(f"{field} path {path!r}: cannot be read ({e.strerror or type(e).__name__})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ValueError(f"{field} path {path!r}: is neither a regular file nor a folder")


def check_model_files(config: EngineConfig) -> None:
    """Every check of this module on the engine's settings; ValueError naming the file and what is wrong."""
    for field in PATH_FIELDS:
        check_path_kind(field, getattr(config, field))
    for field in ("model", "vae"):
        path = os.path.expanduser(getattr(config, field) or "")
        if path.lower().endswith(".gguf") and os.path.isfile(path):
            from dvllm.models.gguf_header import read_gguf_names  # (the gguf package: for a GGUF file only)

            read_gguf_names(path)
    layers: list[tuple[dict[str, Any], str]] = []
    folder = defaults_folder(config.model, config.base_model)
    if folder is not None and os.path.isfile(os.path.join(folder, DEFAULTS_FILE)):
        path = os.path.join(folder, DEFAULTS_FILE)
        layers.append((read_defaults_file(path), path))
    if config.default_params:
        layers.append((config.default_params, "default_params"))
    check_default_size(layers, config.max_image_pixels)


def defaults_folder(model: str | None, base_model: str | None) -> str | None:
    """The local folder whose dvllm_defaults.json the loader reads: the model's, or a single file's base model's
    (None for a Hub id, whose file comes with its configs, and for a model shipped in the package)."""
    if not model or is_packaged(model):
        return None
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) and base_model and not is_packaged(base_model):
        base = os.path.expanduser(base_model)
        return base if os.path.isdir(base) else None
    return None
