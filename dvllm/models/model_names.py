"""What a model name means, without torch: the models shipped in the package (with weights), the presets (configs
only), and whether a name the loader would take for a local path or a Hub id can load at all.

The loader (loader.py) resolves names with these functions; the `dvllm` command checks a name with
check_model_name before it imports torch and diffusers, so that a typo, a missing folder or a Hub id that an
offline machine does not hold is answered in a second, not after a minute of imports and a failed download.
"""
from __future__ import annotations

import difflib
import json
import os
from importlib import resources
from typing import Any

DEFAULT_MODEL = "tiny-shapes"  # trained in the repo (scripts/train_tiny_shapes.py), shipped in the package
OFFLINE_HINT = ("to run offline, set HF_HUB_OFFLINE=1 and name a model the Hugging Face cache holds (fetched once "
                "online: `hf download OWNER/NAME`), a local diffusers folder, or a built-in model (tiny-shapes)")


def builtin_folder(name: str) -> str | None:
    """The path of a model shipped inside the package (with weights), or None."""
    builtin = resources.files("dvllm.models") / "builtin"
    if not builtin.is_dir() or name not in {p.name for p in builtin.iterdir()}:  # a bare name, never a path
        return None
    folder = builtin / name
    return str(folder) if (folder / "model_index.json").is_file() else None


def builtin_names() -> list[str]:
    folder = resources.files("dvllm.models") / "builtin"
    return sorted(p.name for p in folder.iterdir() if builtin_folder(p.name) is not None) if folder.is_dir() else []


def preset_names() -> list[str]:
    folder = resources.files("dvllm.models.presets")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any]:
    """A preset's JSON. One that names a `base` preset is that preset's architecture (its model_index and
    components) with its own description and request `defaults` (param_defaults.py's keys, the loader's layer over
    the known table's): a benchmark's settings on a published architecture without a second copy of it."""
    preset = _read_preset(name)
    base = preset.get("base")
    if base is None:
        return preset
    if base not in preset_names():
        raise ValueError(f"preset {name!r}: its base {base!r} is not a preset")
    parent = _read_preset(base)
    if "base" in parent:  # one level: the architecture is always one file away
        raise ValueError(f"preset {name!r}: its base {base!r} has a base of its own")
    own = {key: value for key, value in preset.items() if key != "base"}
    return {**parent, **own, "base": base}


def _read_preset(name: str) -> dict[str, Any]:
    return json.loads((resources.files("dvllm.models.presets") / f"{name}.json").read_text())


def is_packaged(name: str) -> bool:
    """A built-in model or preset, which the loader takes before any folder of that name."""
    if "/" in name or os.sep in name:
        return False
    models = resources.files("dvllm.models")
    return (models / "builtin" / name / "model_index.json").is_file() or (models / "presets" / f"{name}.json").is_file()


def looks_like_path(model: str) -> bool:
    """A name the loader takes for a local path even when nothing is there (a Hub id is exactly OWNER/NAME)."""
    return model.startswith((".", "/", "~")) or model.count("/") != 1


def check_model_name(model: str | None, offline: bool = False, revision: str | None = None,
                     cache_dir: str | None = None) -> None:
    """ValueError, in a fraction of a second, for a model name that cannot load: a bare name that is no built-in
    model or preset (with the nearest names), a path where nothing is, a string that is no Hub id, or, `offline`
    (HF_HUB_OFFLINE, local_files_only), a Hub id the cache does not hold. An existing path passes: the loader says
    what is wrong with its files."""
    if model is None or is_packaged(model) or os.path.exists(os.path.expanduser(model)):
        return
    if "/" not in model and os.sep not in model:
        known = sorted(set(preset_names()) | set(builtin_names()))
        close = difflib.get_close_matches(model, known, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
        raise ValueError(f"model {model!r} is not a built-in model or preset ({', '.join(known)}), nor a local "
                         f"folder or a Hub id (owner/name){hint}")
    if looks_like_path(model):
        raise ValueError(f"model path {os.path.expanduser(model)!r} does not exist")
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # (no torch: a tenth of a second)

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"model {model!r} is neither a local path nor a Hub id (owner/name, of letters, digits, "
                         "'-', '_' and '.')") from None
    if offline and not hub_cached(model, revision, cache_dir):
        raise ValueError(f"model {model!r} is neither a local folder nor in the Hugging Face cache "
                         f"({cache_dir or _hub_cache()}), and the Hub is off (HF_HUB_OFFLINE=1 or local_files_only): "
                         f"fetch it once online (`hf download {model}`), or name a local diffusers folder or a "
                         "built-in model (tiny-shapes)")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cached(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> bool:
    """Whether the Hub cache holds the pipeline's model_index.json for this revision (what the loader reads first)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "model_index.json", cache_dir=cache_dir, revision=revision), str)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
