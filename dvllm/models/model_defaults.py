"""A model's request defaults, when its pipeline's `__call__` defaults are not what it was made for.

Z-Image-Turbo served with its pipeline's defaults runs 50 steps with CFG, about 12x the compute it was
distilled for. Defaults come, each layer over the one before: the pipeline's; `KNOWN_DEFAULTS` below (facts
from the models' cards, by Hub id, and for the presets of those architectures); the model folder's (or Hub
repo's) `dvllm_defaults.json`; the engine's `default_params`. What is in force is in ModelInfo.defaults, and so in
/v1/models.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any

from dvllm.sampling_params import FPS_RANGE, MAX_FPS, MIN_FPS

DEFAULTS_FILE = "dvllm_defaults.json"  # a model folder's own defaults (steps, guidance, size) for dvllm
MAX_DEFAULTS_FILE_BYTES = 1 << 20  # a few keys: a larger file is no defaults file, and is not read whole
# With no max_image_pixels, the engine's limit is a multiple of the default size itself, so a default size is
# bounded here: 16384x16384 is past any model's native size (a typo of a size would otherwise load the whole
# model before the state pool is found too small for it). max_image_pixels, when set, bounds it instead.
MAX_DEFAULT_PIXELS = 16384 * 16384

# request field -> the ModelInfo.defaults (model_info.Defaults) field it sets
DEFAULTS_FIELDS = {"num_inference_steps": "steps", "guidance_scale": "guidance", "height": "height",
                   "width": "width", "sampler": "sampler"}
# a video model's frames and rate (ModelInfo.video)
VIDEO_FIELDS = {"num_frames": "frames", "fps": "fps"}
# max_sequence_length changes the model's conditions: the adapter takes it (set_max_sequence_length)
KEYS = (*DEFAULTS_FIELDS, *VIDEO_FIELDS, "max_sequence_length")

_TURBO_512 = {"num_inference_steps": 1, "guidance_scale": 0.0, "height": 512, "width": 512}
# By Hub id, lower case. Each from the model card's own example call.
KNOWN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tongyi-mai/z-image-turbo": {"num_inference_steps": 9, "guidance_scale": 0.0},  # 9 steps: 8 DiT forwards
    "black-forest-labs/flux.1-schnell": {"num_inference_steps": 4, "guidance_scale": 0.0},
    "stabilityai/sdxl-turbo": _TURBO_512,
    "stabilityai/sd-turbo": _TURBO_512,
    "stabilityai/stable-diffusion-3.5-large-turbo": {"num_inference_steps": 4, "guidance_scale": 0.0},
    # Wan: the pipeline's own defaults are 480x832 and 81 frames for every model
    "wan-ai/wan2.2-ti2v-5b-diffusers": {"height": 704, "width": 1280, "num_frames": 121, "fps": 24},
    "wan-ai/wan2.1-t2v-14b-diffusers": {"height": 720, "width": 1280},
    "wan-ai/wan2.2-t2v-a14b-diffusers": {"height": 720, "width": 1280, "num_inference_steps": 40,
                                         "guidance_scale": 4.0},
}
# dvllm's presets of those architectures (random weights, for timing) time what the model would run
PRESET_HUB_IDS = {"z-image-turbo": "tongyi-mai/z-image-turbo", "sd-turbo": "stabilityai/sd-turbo",
                  "wan2.2-ti2v-5b": "wan-ai/wan2.2-ti2v-5b-diffusers",
                  "wan2.1-t2v-14b": "wan-ai/wan2.1-t2v-14b-diffusers",
                  "wan2.2-t2v-a14b": "wan-ai/wan2.2-t2v-a14b-diffusers"}


def known_defaults(name: str) -> dict[str, Any]:
    """The table's defaults for a Hub id or preset name ({} for any other model)."""
    key = name.lower()
    return dict(KNOWN_DEFAULTS.get(PRESET_HUB_IDS.get(key, key), {}))


def parse_defaults(value: Any, where: str) -> dict[str, Any]:
    """A dict of defaults (or its JSON text), its keys and values checked; ValueError naming `where`."""
    if isinstance(value, str):
        value = _json(value, where)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object of defaults, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed {sorted(KEYS)}")
    for key, v in value.items():
        if key == "guidance_scale":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")
        elif key == "fps":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_FPS <= v <= MAX_FPS
        elif key == "sampler":
            ok = isinstance(v, str) and bool(v)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        if not ok:
            raise ValueError(f"{where}: {key} must be {_EXPECTED.get(key, 'a positive integer')}, got {v!r}")
    if "sampler" in value:
        from dvllm.sampler_names import SHORT_NAMES, did_you_mean, scheduler_class

        name = value["sampler"]
        if name not in SHORT_NAMES and scheduler_class(name) is None:
            raise ValueError(f"{where}: sampler {name!r} is not a sampler{did_you_mean(name, SHORT_NAMES)}")
    return value


_EXPECTED = {"guidance_scale": "a finite number >= 0", "fps": f"a number in {FPS_RANGE}", "sampler": "a sampler name"}


def _json(text: str, where: str) -> Any:
    """json.loads, its failures named after `where`: bad syntax, nesting past the recursion limit, an integer
    past Python's int() digit limit (which json raises as a plain ValueError, not naming the place)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{where}: not a defaults object: its JSON nests too deeply to read") from None
    except ValueError as e:  # (json raises nothing else but the digit limit's)
        if "digits" not in str(e):
            raise ValueError(f"{where}: cannot be read as JSON ({e})") from None
        raise ValueError(f"{where}: holds a number of more than {sys.get_int_max_str_digits()} digits, past "
                         "any default") from None


def read_defaults_file(path: str) -> dict[str, Any]:
    """A dvllm_defaults.json, read (at most MAX_DEFAULTS_FILE_BYTES) and checked; ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_DEFAULTS_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_DEFAULTS_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_DEFAULTS_FILE_BYTES >> 20} MiB; a defaults file is a JSON object of a "
                         f"few keys ({', '.join(KEYS)})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_defaults(text, path)


def check_default_size(layers: list[tuple[dict[str, Any], str]], max_image_pixels: int | None) -> None:
    """The default height and width that `layers` ((defaults, where they come from), each over the one before)
    set, against max_image_pixels, or MAX_DEFAULT_PIXELS when it is not set: checked before the model loads, when
    its size factor is not known, so on the plain pixel count (a side set alone counts as that many pixels)."""
    size: dict[str, int] = {}
    origin: dict[str, str] = {}
    for defaults, where in layers:
        for key in ("height", "width"):
            if key in defaults:
                size[key], origin[key] = defaults[key], where
    pixels = math.prod(size.values())
    limit = max_image_pixels or MAX_DEFAULT_PIXELS
    if not size or pixels <= limit:
        return
    shown = " x ".join(f"{key} {_count(value)}" for key, value in size.items())
    bound = f"max_image_pixels={limit}" if max_image_pixels else \
        f"{limit} (16384x16384), past any model's size (set max_image_pixels to allow larger)"
    raise ValueError(f"{' and '.join(dict.fromkeys(origin.values()))}: the default size ({shown}) is "
                     f"{_count(pixels)} pixels, over {bound}")


def _count(n: int) -> str:
    """An integer as text, however large (str() refuses past 4300 digits)."""
    return str(n) if n < 10**18 else f"about 10^{round(n.bit_length() * math.log10(2))}"
