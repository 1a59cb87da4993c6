"""What a serving benchmark sends, and when: request specs (fixed, mix, trace, edit) and arrival times.

Everything is drawn from seeded generators, so two runs with the same --seed send the same
requests at the same offsets to whichever server they measure.
"""
from __future__ import annotations

import functools
import io
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^\d+x\d+$")
_TRACE_KEYS = {"prompt", "size", "frames", "num_frames", "steps", "num_inference_steps", "guidance", "guidance_scale",
               "sampler", "seed", "n", "negative_prompt", "slo", "arrival", "loras", "cache", "priority", "deadline", "controls"}
SERVER_DEFAULT = "server-default"  # a request that sends no `cache` field: the server's default_cache applies


@dataclass
class RequestSpec:
    prompt: str
    size: str                     # "WxH"
    steps: int
    guidance: float
    sampler: str | None           # None: the model's own scheduler
    seed: int
    n: int = 1
    negative_prompt: str | None = None
    slo: float | None = None      # seconds from send to answer; None: no SLO
    arrival: float | None = None  # seconds from the start, when a trace fixes it
    # Edit requests (POST /v1/images/edits): the input images as (width, height, pixel seed), made by
    # edit_image_png; None: a generation request.
    images: tuple[tuple[int, int, int], ...] | None = None
    loras: dict[str, float] | None = None  # adapters loaded on the server, by name, with their weights
    cache: dict[str, Any] | None | str = SERVER_DEFAULT  # a step cache ({"method": ...}), None: none
    priority: int | None = None   # lower runs first (the engine's priority)
    deadline: float | None = None  # seconds after arrival the request asks to be done by
    frames: int | None = None     # a video's frames (Wan); None: an image, or the model's default
    # ControlNet controls, each {name, image_seed, scale, start, end}: its image made at the request's size from
    # the seed (control_inputs.control_image); None: none
    controls: tuple[dict[str, Any], ...] | None = None

    @property
    def endpoint(self) -> str:
        return "/v1/images/generations" if self.images is None else "/v1/images/edits"

    def form(self) -> dict[str, str]:
        """The edit request's multipart text fields: body()'s, as strings."""
        return {k: json.dumps(v) if v is None or isinstance(v, dict) else str(v) for k, v in self.body().items()}

    def files(self) -> list[tuple[str, tuple[str, bytes, str]]]:
        """The edit request's file parts: one image as `image`, several as `image[]` in order."""
        if self.images is None:
            return []
        field = "image" if len(self.images) == 1 else "image[]"
        return [(field, (f"input{i}.png", edit_image_png(*image), "image/png")) for i, image in enumerate(self.images)]

    def body(self) -> dict[str, Any]:
        """The POST /v1/images/generations body: dvllm's fields, which the baselines speak too."""
        body: dict[str, Any] = {"prompt": self.prompt, "size": self.size, "n": self.n,
                                "num_inference_steps": self.steps, "guidance_scale": self.guidance,
                                "seed": self.seed, "response_format": "b64_json"}
        if self.sampler is not None:
            body["sampler"] = self.sampler
        if self.negative_prompt is not None:
            body["negative_prompt"] = self.negative_prompt
        if self.loras:
            body["loras"] = dict(self.loras)
        if self.cache != SERVER_DEFAULT:
            body["cache"] = self.cache
        for name in ("priority", "deadline"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.controls:
            body["controls"] = self.control_list(_png_data_url)
        return body

    def control_list(self, image_of: Any) -> list[dict[str, Any]]:
        """The request's controls as the engine takes them, each image `image_of(width, height, seed)`."""
        width, height = (int(v) for v in self.size.split("x"))
        return [{"name": c["name"], "image": image_of(width, height, c["image_seed"]), "scale": c["scale"],
                 "start": c["start"], "end": c["end"]} for c in self.controls or ()]

    @property
    def denoising_steps(self) -> int:
        """Denoising steps the request costs: n images take `steps` steps each."""
        return self.steps * self.n


def _png_data_url(width: int, height: int, seed: int) -> str:
    import base64

    from dvllm.benchmarks.control_inputs import control_image_png

    return "data:image/png;base64," + base64.b64encode(control_image_png(width, height, seed)).decode()


def check_size(size: str, where: str = "size") -> str:
    size = size.strip().lower()
    if not _SIZE.match(size):
        raise ValueError(f"{where} must look like WIDTHxHEIGHT (e.g. 32x32), got {size!r}")
    return size


def split_list(text: str, kind: type, where: str, allow_none: bool = False) -> list[Any]:
    """'a,b,c' -> [kind(a), ...]; with allow_none, 'none' stands for None (the model's default sampler)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{where} is empty")
    try:
        return [None if allow_none and item.lower() == "none" else kind(item) for item in items]
    except ValueError:
        raise ValueError(f"{where} must be a comma-separated list of {kind.__name__}, got {text!r}") from None


def _prompt(prefix: str, index: int, seed: int) -> str:
    # Distinct within a run and across seeds: a repeated prompt would hand dvllm's prompt cache an
    # advantage real traffic lacks (and that the baselines, which encode every prompt, cannot have).
    return f"{prefix}a photo of object number {index} (run {seed})"


def fixed_workload(num: int, *, size: str, steps: int, guidance: float, sampler: str | None, n: int = 1,
                   seed: int = 0, slo: float | None = None, prefix: str = "") -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(_prompt(prefix, i, seed), check_size(size), steps, guidance, sampler,
                        rng.randrange(2**31), n=n, slo=slo) for i in range(num)]


def mix_workload(num: int, *, sizes: list[str], steps: list[int], guidances: list[float],
                 samplers: list[str | None], seed: int = 0, slo: float | None = None,
                 prefix: str = "") -> list[RequestSpec]:
    """Each request draws its size, step count, guidance (<= 1: no CFG) and sampler independently."""
    rng = random.Random(seed)
    sizes = [check_size(s, "--mix-sizes") for s in sizes]
    return [RequestSpec(_prompt(prefix, i, seed), rng.choice(sizes), rng.choice(steps),
                        rng.choice(guidances), rng.choice(samplers), rng.randrange(2**31), slo=slo)
            for i in range(num)]


@functools.lru_cache(maxsize=256)
def edit_image_png(width: int, height: int, seed: int) -> bytes:
    """A seeded input image as PNG: a random background colour, a rectangle and an ellipse of random
    colours and places, and some pixel noise. The same arguments always give the same bytes."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(image)
    for shape in (draw.rectangle, draw.ellipse):
        x0, y0 = rng.randrange(width // 2), rng.randrange(height // 2)
        shape((x0, y0, x0 + rng.randrange(4, width // 2 + 5), y0 + rng.randrange(4, height // 2 + 5)), fill=colour())
    pixels = np.asarray(image, dtype=np.int16)
    noise = np.random.default_rng(seed).integers(-12, 13, size=pixels.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


EDIT_NEGATIVE_PROMPT = "blurry, low quality, distorted"


def edit_workload(num: int, *, size: str, image_sizes: list[str], images_per_request: list[int], steps: list[int],
                  guidances: list[float], seed: int = 0, slo: float | None = None,
                  prefix: str = "") -> list[RequestSpec]:
    """Edit requests: each draws its step count, guidance, how many input images and each image's size
    independently; a request with guidance > 1 carries a negative prompt (Qwen-Image's CFG runs only
    with one), the others none. The output size is `size` for all."""
    rng = random.Random(seed)
    dims = [tuple(int(v) for v in check_size(s, "--edit-image-sizes").split("x")) for s in image_sizes]
    if not images_per_request or min(images_per_request) < 1:
        raise ValueError(f"--edit-images must be >= 1 each, got {images_per_request}")
    specs = []
    for i in range(num):
        count, step, guidance = rng.choice(images_per_request), rng.choice(steps), rng.choice(guidances)
        images = tuple((*rng.choice(dims), rng.randrange(2**31)) for _ in range(count))
        prompt = f"{prefix}edit number {i} (run {seed}): make the shapes {rng.choice(['red', 'blue', 'green'])}"
        specs.append(RequestSpec(prompt, check_size(size), step, guidance, None, rng.randrange(2**31), slo=slo,
                                 negative_prompt=EDIT_NEGATIVE_PROMPT if guidance > 1 else None,
                                 images=images))
    return specs


def trace_workload(path: str, *, size: str, steps: int, guidance: float, sampler: str | None,
                   seed: int = 0, slo: float | None = None) -> list[RequestSpec]:
    """One request per JSONL line; a field a line leaves out takes the command line's value."""
    rng = random.Random(seed)
    specs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{where}: each line must be a JSON object with a string 'prompt'")
            unknown = set(record) - _TRACE_KEYS
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(_TRACE_KEYS)}")
            specs.append(_trace_spec(record, where, rng, size=size, steps=steps, guidance=guidance,
                                     sampler=sampler, slo=slo))
    if not specs:
        raise ValueError(f"{path} holds no requests")
    with_arrival = sum(s.arrival is not None for s in specs)
    if with_arrival not in (0, len(specs)):
        raise ValueError(f"{path}: give 'arrival' on every line or on none ({with_arrival} of {len(specs)} have it)")
    if with_arrival:
        if min(s.arrival for s in specs) < 0:
            raise ValueError(f"{path}: 'arrival' is seconds from the start, so >= 0")
        specs.sort(key=lambda s: s.arrival)  # sent in time order, whatever the file's order
    return specs


def _trace_spec(record: dict[str, Any], where: str, rng: random.Random, *, size: str, steps: int,
                guidance: float, sampler: str | None, slo: float | None) -> RequestSpec:
    def get(*names: str, default: Any) -> Any:
        return next((record[k] for k in names if k in record), default)

    try:
        spec = RequestSpec(
            prompt=record["prompt"], size=check_size(str(get("size", default=size)), f"{where}: size"),
            steps=int(get("steps", "num_inference_steps", default=steps)),
            guidance=float(get("guidance", "guidance_scale", default=guidance)),
            sampler=get("sampler", default=sampler), seed=int(get("seed", default=rng.randrange(2**31))),
            n=int(get("n", default=1)), negative_prompt=get("negative_prompt", default=None),
            slo=_optional_float(get("slo", default=slo)), arrival=_optional_float(get("arrival", default=None)),
            loras=_loras(record.get("loras")), cache=_cache(record.get("cache", SERVER_DEFAULT)),
            priority=None if record.get("priority") is None else _int(record["priority"], "priority"),
            deadline=_optional_float(record.get("deadline")), controls=_controls(record.get("controls")),
            frames=None if get("frames", "num_frames", default=None) is None
            else _int(get("frames", "num_frames", default=None), "frames"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if spec.steps < 1 or spec.n < 1 or (spec.slo is not None and spec.slo <= 0) or (spec.frames or 1) < 1:
        raise ValueError(f"{where}: steps, n and frames must be >= 1 and slo > 0")
    if spec.deadline is not None and not spec.deadline > 0:
        raise ValueError(f"{where}: deadline is seconds after arrival, so > 0")
    return spec


def _loras(value: Any) -> dict[str, float] | None:
    """A trace's `loras`: {name: weight}, as the server takes them (which names exist, the server says)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"loras must be an object of adapter name -> weight, got {value!r}")
    weights = {name: float(weight) for name, weight in value.items()}
    if not all(math.isfinite(w) for w in weights.values()):
        raise ValueError(f"loras: weights must be finite numbers, got {value!r}")
    return weights


def _controls(value: Any) -> tuple[dict[str, Any], ...] | None:
    """A trace's `controls`: [{name, image_seed, scale, start, end}] (which names exist, the server says)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              and "image_seed" in c for c in value):
        raise ValueError(f"controls must be a list of {{name, image_seed, scale, start, end}}, got {value!r}")
    return tuple({"name": c["name"], "image_seed": _int(c["image_seed"], "controls' image_seed"),
                  "scale": float(c.get("scale", 1.0)), "start": float(c.get("start", 0.0)),
                  "end": float(c.get("end", 1.0))} for c in value) or None


def _cache(value: Any) -> dict[str, Any] | None | str:
    if value is None or value == SERVER_DEFAULT:
        return value
    if not isinstance(value, dict) or not isinstance(value.get("method"), str):
        raise ValueError(f"cache must be null or an object with a 'method' (first_block, taylorseer, mag), got {value!r}")
    return dict(value)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds. Inter-arrival gaps are gamma-distributed with mean 1/rate: shape
    `burstiness` 1.0 is a Poisson process, lower is burstier, higher more even. rate inf: all at 0."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(num):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times
