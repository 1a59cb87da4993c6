"""Request defaults as a model folder's dvllm_defaults.json and the engine's default_params write them: their
keys, their values' checks and their size bound (no torch, no models: the engine config parses default_params
with it, the loader reads the files with it; the known models' own defaults are in models/model_defaults.py)."""
from __future__ import annotations

import json
import math
import sys
from typing import Any

# A video's frame rate. Its MP4 carries the rate as a fraction of denominator <= 1001 (video/mp4.py): below
# 1/1000 fps that fraction is far off, or 0, which the muxer replaces with 24 fps without a word.
MIN_FPS = 0.001
MAX_FPS = 240.0
FPS_RANGE = f"[{MIN_FPS:g}, {MAX_FPS:g}]"
AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5  # the SDXL img2img and inpainting pipelines' defaults
DEFAULT_PIXELS_FACTOR = 4  # the engine's default max_image_pixels: this many times an image model's native area
DEFAULTS_FILE = "dvllm_defaults.json"  # a model folder's own defaults (steps, guidance, size) for dvllm
MAX_DEFAULTS_FILE_BYTES = 1 << 20  # a few keys: a larger file is no defaults file, and is not read whole
# With no max_image_pixels, the engine's limit is a multiple of the default size itself, so a default size is
# bounded here: 16384x16384 is past any model's native size (a typo of a size would otherwise load the whole
# model before the state pool is found too small for it). max_image_pixels, when set, bounds it instead.
MAX_DEFAULT_PIXELS = 16384 * 16384

# request field -> the ModelInfo.defaults (model_info.Defaults) field it sets
DEFAULTS_FIELDS = {"num_inference_steps": "steps", "guidance_scale": "guidance", "height": "height",
                   "width": "width", "sampler": "sampler", "guidance_scale_2": "guidance_2"}
GUIDANCE_KEYS = ("guidance_scale", "guidance_scale_2")
# a video model's frames and rate (ModelInfo.video)
VIDEO_FIELDS = {"num_frames": "frames", "fps": "fps"}
# max_sequence_length changes the model's conditions: the adapter takes it (set_max_sequence_length)
KEYS = (*DEFAULTS_FIELDS, *VIDEO_FIELDS, "max_sequence_length")


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
        if key in GUIDANCE_KEYS:
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


_EXPECTED = {"guidance_scale": "a finite number >= 0", "guidance_scale_2": "a finite number >= 0",
             "fps": f"a number in {FPS_RANGE}", "sampler": "a sampler name"}


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
