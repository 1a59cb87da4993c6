"""`dvllm generate`'s requests: the command line's flags and a --prompts-file's lines, checked as far
as possible without the model (so a typo costs a second, not a model load), then by the engine's input
processor before any is queued."""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from dvllm.entrypoints.mask_upload import mask_from_upload
from dvllm.sampler_names import SHORT_NAMES, did_you_mean, scheduler_class
from dvllm.param_defaults import FPS_RANGE, MAX_FPS, MIN_FPS
from dvllm.sampling_params import PARAM_ALIASES, SEED_LIMIT, SamplingParams, lora_weight
from dvllm.step_cache import parse_cache_flag
from dvllm.video.save import VIDEO_SUFFIX

if TYPE_CHECKING:
    from dvllm.core.request import Request
    from dvllm.engine.engine import DiffusionEngine

# JSONL keys accepted in --prompts-file, besides "prompt" and "output"
_JSONL_KEYS = {"num_inference_steps", "steps", "guidance_scale", "guidance", "negative_prompt", "seed", "size",
               "height", "width", "n", "sampler", "cache", "loras", "strength", "aesthetic_score",
               "negative_aesthetic_score", "num_frames", "fps", "controls", "ip_adapter_image", "ip_adapter_scale"}
_INPUT_KEYS = ("image", "mask")  # input files: relative paths are under the prompts file's folder
_NULLABLE_KEYS = {"cache", "loras"}  # a line's null means none: no step cache, no adapters (not the flag's)


def check_sampler(name: object) -> None:
    """A short name or a diffusers scheduler class: which one the model gets is decided later, but a
    name that is neither can be refused now."""
    if isinstance(name, str) and (name in SHORT_NAMES or scheduler_class(name) is not None):
        return
    raise ValueError(f"sampler must be one of {sorted(SHORT_NAMES)} or the class name of a diffusers scheduler, "
                     f"got {name!r}{did_you_mean(name, SHORT_NAMES)}")



_SIZE = re.compile(r"([0-9]+)x([0-9]+)")  # ASCII digits only: str.isdigit() would take "６４"


def parse_size(size: object) -> tuple[int, int]:
    """'WxH' -> (height, width); exactly digits, a lowercase x, digits."""
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 512x512), got {size!r}")
    return int(match.group(2)), int(match.group(1))


# Short names (CLI flags, JSONL) -> SamplingParams fields
_ALIASES = PARAM_ALIASES


def _long_names(fields: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in fields.items():
        if value is None and key not in _NULLABLE_KEYS:
            continue
        if key == "size":
            out["height"], out["width"] = parse_size(value)
        elif key in _ALIASES and _ALIASES[key] in fields:
            raise ValueError(f"{key!r} is short for {_ALIASES[key]!r}: give one of them")
        else:
            out[_ALIASES.get(key, key)] = value
    return out


def _params(fields: dict[str, Any], defaults: dict[str, Any],
            inputs: dict[str, Any] | None = None) -> SamplingParams:
    """Checked as far as possible without the model. Both sides are normalized first, so a line's
    "num_inference_steps" beats the CLI's --steps. `inputs`: the image path(s) and the converted mask."""
    params = SamplingParams(**{**_long_names(defaults), **_long_names(fields), **(inputs or {})})
    params.validate()
    if params.sampler is not None:
        check_sampler(params.sampler)
    return params


def parse_lora_flags(values: list[str] | None) -> dict[str, float]:
    """--lora NAME[=WEIGHT], repeated -> {name: weight}; the weight is 1.0 unless given."""
    loras: dict[str, float] = {}
    for value in values or []:
        name, sep, text = value.partition("=")
        if not name:
            raise ValueError(f"expected NAME or NAME=WEIGHT, got {value!r}")
        if name in loras:
            raise ValueError(f"{name!r} is given twice")
        try:
            weight = float(text) if sep else 1.0
        except ValueError:
            raise ValueError(f"the weight of {name!r} must be a number, got {text!r}") from None
        loras[name] = lora_weight(name, weight)
    return loras


def _output_path(value: object, where: str, output_dir: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: 'output' must be a file name, got {value!r}")
    suffix = os.path.splitext(value)[1].lower()
    if suffix != VIDEO_SUFFIX and suffix not in Image.registered_extensions():
        raise ValueError(f"{where}: 'output' needs an image extension such as .png (or {VIDEO_SUFFIX} for a video "
                         f"model), got {value!r}")
    return os.path.join(output_dir, value)  # relative names go under --output-dir


def check_output_kind(jobs: list[Job], video: bool) -> None:
    """Once the model is known: a video model's outputs are MP4 files, an image model's are images."""
    for job in jobs:
        if job.output is None or (os.path.splitext(job.output)[1].lower() == VIDEO_SUFFIX) == video:
            continue
        where = "-o/--output" if job.where == "command line" else f"{job.where}: 'output'"
        want = f"a {VIDEO_SUFFIX} name" if video else f"an image name such as .png, not {VIDEO_SUFFIX}"
        raise ValueError(f"{where}: this model makes {'videos' if video else 'images'}: give {want}, "
                         f"got {job.output!r}")


@dataclass(frozen=True)
class Job:
    """One request of the command line or of a --prompts-file line."""

    prompt: str
    params: SamplingParams
    output: str | None  # the file asked for, or None for the default name
    where: str          # for messages: "command line" or "file:line"
    inputs: dict[str, Any] = field(default_factory=dict)  # the input files' paths, for the PNGs and manifest


class _Inputs:
    """The input files of a run (--image, --mask, a line's "image" and "mask"), checked before the model
    loads. Each mask is read and converted once (mask_upload.py), however many lines name it."""

    def __init__(self) -> None:
        self._masks: dict[str, Image.Image] = {}
        self._sizes: dict[str, tuple[int, int]] = {}

    def paths(self, key: str, value: object, base: str) -> str | list[str]:
        """A path, or for "image" a list of them, each an image file; relative ones under `base`."""
        values = value if key == "image" and isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and v for v in values):
            kind = "a path or a list of paths" if key == "image" else "a path"
            raise ValueError(f"must be {kind} to an image file, got {value!r}")
        paths = [os.path.join(base, os.path.expanduser(v)) for v in values]
        for path in paths:
            self._size(path)
        return paths if isinstance(value, list) else paths[0]

    def params(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams fields of a job's input paths: the image path(s) as they are (the engine reads
        them), the mask as diffusers' grey mask, checked against the image's size."""
        if "mask" not in inputs:
            return {"image": inputs.get("image")}
        image, mask = inputs.get("image"), self._mask(inputs["mask"])
        if isinstance(image, str) and self._size(image) != mask.size:
            (w, h), (mw, mh) = self._size(image), mask.size
            raise ValueError(f"mask {inputs['mask']!r} is {mw}x{mh}, but image {image!r} is {w}x{h}: the mask "
                             "must have the image's size")
        return {"image": image, "mask_image": mask}

    def _size(self, path: str) -> tuple[int, int]:
        if path not in self._sizes:
            if not os.path.isfile(path):
                raise ValueError(f"no such file: {path!r}")
            try:
                with Image.open(path) as image:  # the header only
                    self._sizes[path] = image.size
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
                raise ValueError(f"cannot read {path!r} as an image: {e}") from None
        return self._sizes[path]

    def _mask(self, path: str) -> Image.Image:
        if path not in self._masks:
            try:
                with Image.open(path) as image:
                    self._masks[path] = mask_from_upload(image)
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
                raise ValueError(f"cannot read mask {path!r} as an image: {e}") from None
        return self._masks[path]


def check_generate_flags(args: argparse.Namespace) -> None:
    """The request flags, named as the user typed them."""
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.n < 1:
        raise ValueError(f"-n must be >= 1, got {args.n}")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.guidance is not None and not 0 <= args.guidance < float("inf"):
        raise ValueError(f"--guidance must be a finite number >= 0, got {args.guidance}")
    if args.size is not None:
        try:
            parse_size(args.size)
        except ValueError as e:
            raise ValueError(f"--size: {e}") from None
    if args.sampler is not None:
        try:
            check_sampler(args.sampler)
        except ValueError as e:
            raise ValueError(f"--sampler: {e}") from None
    if args.cache is not None:
        try:
            parse_cache_flag(args.cache)
        except ValueError as e:
            raise ValueError(f"--cache: {e}") from None
    try:
        parse_lora_flags(args.lora)
    except ValueError as e:
        raise ValueError(f"--lora: {e}") from None
    if args.strength is not None and not 0 < args.strength <= 1:
        raise ValueError(f"--strength must be in (0, 1], got {args.strength}")
    if args.num_frames is not None and args.num_frames < 1:
        raise ValueError(f"--num-frames must be >= 1, got {args.num_frames}")
    if args.fps is not None and not MIN_FPS <= args.fps <= MAX_FPS:
        raise ValueError(f"--fps must be a number in {FPS_RANGE}, got {args.fps}")
    if args.prompts_file is None and args.image is None:  # a file's lines may bring their own image
        for flag, value in (("--mask", args.mask), ("--strength", args.strength)):
            if value is not None:
                raise ValueError(f"{flag} needs --image (the image to {'inpaint' if flag == '--mask' else 'edit'})")


def _flag_inputs(args: argparse.Namespace, inputs: _Inputs) -> dict[str, Any]:
    """--image (repeated: a list, for models that take several) and --mask, as paths, checked."""
    found: dict[str, Any] = {}
    for key, value in (("image", args.image), ("mask", args.mask)):
        if value is None:
            continue
        try:
            found[key] = inputs.paths(key, value[0] if key == "image" and len(value) == 1 else value, "")
        except ValueError as e:
            raise ValueError(f"--{key}: {e}") from None
    return found


def read_jobs(args: argparse.Namespace) -> list[Job]:
    """Every image request on the command line or in the file, checked as far as the model allows."""
    check_generate_flags(args)
    defaults = {"steps": args.steps, "guidance": args.guidance, "negative_prompt": args.negative_prompt,
                "seed": args.seed, "size": args.size, "sampler": args.sampler, "n": args.n,
                "strength": args.strength, "aesthetic_score": args.aesthetic_score,
                "negative_aesthetic_score": args.negative_aesthetic_score, "num_frames": args.num_frames,
                "fps": args.fps}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    if args.cache is not None:
        defaults["cache"] = parse_cache_flag(args.cache)
    if args.lora:
        defaults["loras"] = parse_lora_flags(args.lora)
    inputs = _Inputs()
    flag_paths = _flag_inputs(args, inputs)
    if args.prompts_file is None:
        if not args.prompt:
            raise ValueError("give a prompt or --prompts-file")
        try:
            fields = inputs.params(flag_paths)
        except ValueError as e:
            raise ValueError(f"--mask: {e}") from None
        jobs = [Job(args.prompt, _params({}, defaults, fields), args.output, "command line", flag_paths)]
        _check_sizes(jobs, getattr(args, "max_image_pixels", None))
        return jobs
    if args.prompt:
        raise ValueError("give either a prompt or --prompts-file, not both")
    plain: SamplingParams | None = None  # one object for every plain line: they all ask the same
    jobs = []
    with open(args.prompts_file) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            where = f"{args.prompts_file}:{number}"
            if line.startswith("{"):
                jobs.append(_jsonl_job(line, where, defaults, args, flag_paths, inputs))
            elif line:
                plain = plain or _plain_params(defaults, flag_paths, where, inputs)
                jobs.append(Job(line, plain, None, where, flag_paths))
    if not jobs:
        raise ValueError(f"{args.prompts_file} holds no prompts")
    _check_sizes(jobs, getattr(args, "max_image_pixels", None))
    return jobs


def _check_sizes(jobs: list[Job], max_image_pixels: int | None) -> None:
    """A size past --max-image-pixels is refused now, not once the model has loaded (without the flag, the
    limit depends on the model's native size: the engine checks it)."""
    for job in jobs:
        p = job.params
        if max_image_pixels and p.height and p.width and p.height * p.width > max_image_pixels:
            raise ValueError(f"{job.where}: size {p.width}x{p.height} is {p.width * p.height} pixels, more than "
                             f"--max-image-pixels {max_image_pixels}")


def _plain_params(defaults: dict[str, Any], flag_paths: dict[str, Any], where: str, inputs: _Inputs) -> SamplingParams:
    """The flags' request, which every plain line of a prompts file asks for."""
    fields = _job_inputs(flag_paths, where, inputs)
    try:
        return _params({}, defaults, fields)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _job_inputs(paths: dict[str, Any], where: str, inputs: _Inputs) -> dict[str, Any]:
    """A prompts file line's input fields; its mask needs an image (the line's or --image's)."""
    if "mask" in paths and "image" not in paths:
        raise ValueError(f"{where}: a mask needs an image to inpaint: give the line an \"image\" or give --image")
    try:
        return inputs.params(paths)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _jsonl_job(line: str, where: str, defaults: dict[str, Any], args: argparse.Namespace,
               flag_paths: dict[str, Any], inputs: _Inputs) -> Job:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    unknown = set(record) - _JSONL_KEYS - {"prompt", "output", *_INPUT_KEYS}
    if unknown or not isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}: needs a string 'prompt'; unknown keys {sorted(unknown)}; "
                         f"allowed {sorted(_JSONL_KEYS | set(_INPUT_KEYS))}")
    paths = dict(flag_paths)
    for key in _INPUT_KEYS:
        if record.get(key) is not None:  # null: the flag's
            try:
                paths[key] = inputs.paths(key, record[key], os.path.dirname(args.prompts_file))
            except ValueError as e:
                raise ValueError(f"{where}: {key}: {e}") from None
    fields = _job_inputs(paths, where, inputs)
    if isinstance(record.get("controls"), list):  # their image paths, as the line's own, under the file's folder
        record = dict(record, controls=[_control_paths(c, os.path.dirname(args.prompts_file))
                                        for c in record["controls"]])
        paths["controls"] = [c.get("image") if isinstance(c, dict) else None for c in record["controls"]]
    if isinstance(record.get("ip_adapter_image"), str):  # an image path, as the line's own, under the file's folder
        image = os.path.join(os.path.dirname(args.prompts_file), os.path.expanduser(record["ip_adapter_image"]))
        record = dict(record, ip_adapter_image=image)
        paths["ip_adapter_image"] = image
    try:
        params = _params({k: record[k] for k in _JSONL_KEYS & set(record)}, defaults, fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    output = _output_path(record["output"], where, args.output_dir) if "output" in record else None
    return Job(record["prompt"], params, output, where, paths)


def _control_paths(control: Any, folder: str) -> Any:
    """A line's control with a relative image path made the prompts file folder's (the rest is checked later)."""
    if isinstance(control, dict) and isinstance(control.get("image"), str):
        return dict(control, image=os.path.join(folder, os.path.expanduser(control["image"])))
    return control


def check_lora_names(args: argparse.Namespace, jobs: list[Job], modules: dict[str, str]) -> None:
    """`dvllm generate` has only the adapters of --lora-modules: any other name is a typo, refused before the
    model loads (the flag's names first, so a typo there is not blamed on the file's first line)."""
    def check(loras: dict[str, float] | None, where: str) -> None:
        unknown = sorted(set(loras or {}) - set(modules))
        if unknown:
            raise ValueError(f"{where}: unknown LoRA adapter(s) {unknown}; --lora-modules loads "
                             f"{sorted(modules) if modules else 'none'}")

    check(parse_lora_flags(args.lora), "--lora")
    for job in jobs:
        check(job.params.loras, job.where)


def process(jobs: list[Job], engine: DiffusionEngine) -> list[Request]:
    """Each job through the engine's input processor (the model's defaults and every limit, the sampler's
    plan), before any is queued: a bad line is a usage error, not a failure after an hour of others'
    images. The requests go to the engine as they are (add_processed): checked once."""
    check_output_kind(jobs, video=engine.model_info.video is not None)
    requests = []
    for index, job in enumerate(jobs):
        try:
            requests.append(engine.processor.process(f"cli-{index}", job.prompt, job.params))
        except ValueError as e:
            raise ValueError(str(e) if job.where == "command line" else f"{job.where}: {e}") from None
    return requests
