"""`dvllm generate`'s requests: the command line's flags and a --prompts-file's lines, checked as far
as possible without the model (so a typo costs a second, not a model load), then by the engine's input
processor before any is queued."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from dvllm.samplers.registry import SHORT_NAMES, scheduler_class
from dvllm.sampling_params import SEED_LIMIT, SamplingParams, lora_weight
from dvllm.step_cache import parse_cache_flag

if TYPE_CHECKING:
    from dvllm.core.request import Request
    from dvllm.engine.engine import DiffusionEngine

# JSONL keys accepted in --prompts-file, besides "prompt" and "output"
_JSONL_KEYS = {"num_inference_steps", "steps", "guidance_scale", "guidance", "negative_prompt", "seed", "size",
               "height", "width", "n", "sampler", "cache", "loras"}
_NULLABLE_KEYS = {"cache", "loras"}  # a line's null means none: no step cache, no adapters (not the flag's)


def check_sampler(name: object) -> None:
    """A short name or a diffusers scheduler class: which one the model gets is decided later, but a
    name that is neither can be refused now."""
    if isinstance(name, str) and (name in SHORT_NAMES or scheduler_class(name) is not None):
        return
    close = difflib.get_close_matches(str(name), list(SHORT_NAMES), n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"sampler must be one of {sorted(SHORT_NAMES)} or the class name of a diffusers scheduler, "
                     f"got {name!r}{hint}")



_SIZE = re.compile(r"([0-9]+)x([0-9]+)")  # ASCII digits only: str.isdigit() would take "６４"


def parse_size(size: object) -> tuple[int, int]:
    """'WxH' -> (height, width); exactly digits, a lowercase x, digits."""
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 512x512), got {size!r}")
    return int(match.group(2)), int(match.group(1))


# Short names (CLI flags, JSONL) -> SamplingParams fields
_ALIASES = {"steps": "num_inference_steps", "guidance": "guidance_scale"}


def _long_names(fields: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in fields.items():
        if value is None and key not in _NULLABLE_KEYS:
            continue
        if key == "size":
            out["height"], out["width"] = parse_size(value)
        else:
            out[_ALIASES.get(key, key)] = value
    return out


def _params(fields: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """Checked as far as possible without the model. Both sides are normalized first, so a line's
    "num_inference_steps" beats the CLI's --steps."""
    params = SamplingParams(**{**_long_names(defaults), **_long_names(fields)})
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
    if os.path.splitext(value)[1].lower() not in Image.registered_extensions():
        raise ValueError(f"{where}: 'output' needs an image extension such as .png, got {value!r}")
    return os.path.join(output_dir, value)  # relative names go under --output-dir


@dataclass(frozen=True)
class Job:
    """One request of the command line or of a --prompts-file line."""

    prompt: str
    params: SamplingParams
    output: str | None  # the file asked for, or None for the default name
    where: str          # for messages: "command line" or "file:line"


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


def read_jobs(args: argparse.Namespace) -> list[Job]:
    """Every image request on the command line or in the file, checked as far as the model allows."""
    check_generate_flags(args)
    defaults = {"steps": args.steps, "guidance": args.guidance, "negative_prompt": args.negative_prompt,
                "seed": args.seed, "size": args.size, "sampler": args.sampler, "n": args.n}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    if args.cache is not None:
        defaults["cache"] = parse_cache_flag(args.cache)
    if args.lora:
        defaults["loras"] = parse_lora_flags(args.lora)
    if args.prompts_file is None:
        if not args.prompt:
            raise ValueError("give a prompt or --prompts-file")
        return [Job(args.prompt, _params({}, defaults), args.output, "command line")]
    if args.prompt:
        raise ValueError("give either a prompt or --prompts-file, not both")
    plain = _params({}, defaults)  # one object for every plain line: they all ask the same
    jobs = []
    with open(args.prompts_file) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            where = f"{args.prompts_file}:{number}"
            if line:
                jobs.append(Job(line, plain, None, where) if not line.startswith("{")
                            else _jsonl_job(line, where, defaults, args.output_dir))
    if not jobs:
        raise ValueError(f"{args.prompts_file} holds no prompts")
    return jobs


def _jsonl_job(line: str, where: str, defaults: dict[str, Any], output_dir: str) -> Job:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    unknown = set(record) - _JSONL_KEYS - {"prompt", "output"}
    if unknown or not isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}: needs a string 'prompt'; unknown keys {sorted(unknown)}; "
                         f"allowed {sorted(_JSONL_KEYS)}")
    try:
        params = _params({k: record[k] for k in _JSONL_KEYS & set(record)}, defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    output = _output_path(record["output"], where, output_dir) if "output" in record else None
    return Job(record["prompt"], params, output, where)


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
    requests = []
    for index, job in enumerate(jobs):
        try:
            requests.append(engine.processor.process(f"cli-{index}", job.prompt, job.params))
        except ValueError as e:
            raise ValueError(str(e) if job.where == "command line" else f"{job.where}: {e}") from None
    return requests
