"""SamplingParams: what one request asks for. None means "the model's default"."""
from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dvllm.controls import parse_controls
from dvllm.ip_adapters import check_ip_adapter_scale
from dvllm.lora.files import check_lora_name
from dvllm.param_defaults import AESTHETIC_SCORE, FPS_RANGE, MAX_FPS, MIN_FPS, NEGATIVE_AESTHETIC_SCORE
from dvllm.request_images import (
    control_size,
    default_size,
    load_controls,
    load_image_prompt,
    load_images,
    load_mask,
)
from dvllm.request_sizes import size_of
from dvllm.step_cache import USE_DEFAULT, check_served, parse_cache, show_value

if TYPE_CHECKING:
    from dvllm.config import EngineConfig
    from dvllm.models.base import ModelInfo

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
# As vLLM's output kinds: "progress" reports every step (and previews); "final" only the end, so a
# client that does not stream costs no output per step (nothing crosses threads until it is done).
OUTPUT_KINDS = ("progress", "final")
# Documented short names of two fields, taken wherever requests are written (HTTP bodies, JSONL lines):
# the long name is what every output (manifest, PNG metadata, /v1/models) says.
PARAM_ALIASES = {"steps": "num_inference_steps", "guidance": "guidance_scale"}
SEED_LIMIT = 2**63
# Seeds drawn for requests that name none stay below 2**53, so that JavaScript (a browser client, the
# playground), whose numbers are doubles, shows and sends back exactly the seed that made the image.
RANDOM_SEED_LIMIT = 2**53
PRIORITY_LIMIT = 2**31  # priority is a 32-bit signed integer
MAX_SAMPLER_CHARS = 128
MAX_LORA_WEIGHT = 100.0  # as ComfyUI's LoRA strength; far past it the images are NaN, not stronger
# Adapters one request may name: far more than any engine's max_loras (resident slots, checked in resolve),
# so that a body naming thousands is refused before each name is looked at.
MAX_REQUEST_LORAS = 256


@dataclass
class SamplingParams:
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    n: int = 1
    sampler: str | None = None
    output_type: str = "pil"
    priority: int = 0
    num_previews: int = 0  # partial images decoded from the x0 estimate, spread over the steps
    output_kind: str = "progress"
    # Image-to-image: a PIL image, an HxWx3 uint8 array or a file path; strength in (0, 1] is how much of
    # the schedule it runs (1.0 ignores the image's content). None: the model's default strength.
    # Models that edit from several images (Qwen-Image-Edit Plus) take a list of them.
    image: Any = None
    strength: float | None = None
    # Inpainting (with image): a mask of the image's size, white where to repaint, as diffusers' inpainting
    # pipelines take it (made grey and binarized at 0.5). Its default strength and size are the inpainting
    # pipeline's (1.0 and the model's default size; SDXL's strength 0.9999), not img2img's.
    mask_image: Any = None
    # DDIM's eta (and TCD's gamma), for pipelines that take one (SD, SDXL). None: the pipeline's default (0.0).
    eta: float | None = None
    # The text encoder's token limit, where the pipeline takes one (Qwen-Image, Z-Image; Flux and SD3 at
    # their default only). None: the pipeline's __call__ default.
    max_sequence_length: int | None = None
    # Step caching: {"method": <a method of dvllm/step_caches/registry.py>, **that method's fields}
    # (step_cache.py); "default": the engine's default_cache; None: none. Resolved to a CacheConfig or None.
    cache: Any = USE_DEFAULT
    # LoRA adapters loaded into the engine, by name, with their weights: {"style": 0.8, "product": 1.0}
    # applies each as diffusers' set_adapters(names, adapter_weights) does. None or {}: none.
    loras: dict[str, float] | None = None
    # SDXL models trained with an aesthetic score (the refiner; requires_aesthetics_score): the score the
    # prompt's rows and the negative rows condition on, as the img2img and inpainting pipelines take them.
    # None: their defaults (6.0 and 2.5). Other models take none.
    aesthetic_score: float | None = None
    negative_aesthetic_score: float | None = None
    # Seconds after arrival by which its images should be done: whether they were is reported
    # (RequestOutput.metrics.deadline_met, stats' deadlines_met/missed), and the elastic group policy runs a
    # request that would miss it ahead of the rest (docs/design.md, "Worker groups"). None: no deadline.
    deadline_s: float | None = None
    # Video models (Wan): the video's frames (num_frames - 1 a multiple of the VAE's temporal compression,
    # 4) and the frame rate its MP4 is written at. None: the model's defaults. Image models take neither.
    num_frames: int | None = None
    fps: float | None = None
    # Two-expert models (Wan 2.2 A14B): the guidance scale while the second, low-noise expert runs. None: the
    # request's guidance_scale where it names one (as the pipeline), else the model's default (Defaults.guidance_2,
    # else its guidance default). Other models take none.
    guidance_scale_2: float | None = None
    # ControlNet: [{"name": <a controlnet the engine loaded>, "image": <its conditioning image>, "scale": 1.0,
    # "start": 0.0, "end": 1.0, "mode": <a union controlnet's control mode>}, ...] (dvllm/controls.py), as
    # diffusers' ControlNet pipelines take them; resolved to a tuple of Controls with RGB PIL images. Without a
    # size, the first control image's gives it (as there).
    controls: Any = None
    # IP-Adapter: an image prompt (a PIL image, an HxWx3 uint8 array or a path) for the engine's IP-Adapter
    # (EngineConfig.ip_adapter), weighted by ip_adapter_scale (what diffusers' set_ip_adapter_scale sets; 0: the
    # image does nothing) (dvllm/ip_adapters.py)
    ip_adapter_image: Any = None
    ip_adapter_scale: float = 1.0

    @property
    def size(self) -> tuple[int, ...]:
        return size_of(self.height, self.width, self.num_frames)

    def validate(self) -> None:
        """Checks that need no model; raises ValueError naming the field."""
        _optional_int("num_inference_steps", self.num_inference_steps, low=1)
        _optional_int("height", self.height, low=1)
        _optional_int("width", self.width, low=1)
        _optional_int("n", self.n, low=1)
        _optional_int("num_frames", self.num_frames, low=1)
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, (int, float))
                                     or not MIN_FPS <= self.fps <= MAX_FPS):
            raise ValueError(f"fps must be a number in {FPS_RANGE}, got {self.fps!r}")
        if self.seed is not None:
            _optional_int("seed", self.seed, low=0)
            if self.seed >= SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("guidance_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.negative_prompt is not None:
            check_text("negative_prompt", self.negative_prompt)
        if self.sampler is not None:
            check_text("sampler", self.sampler, MAX_SAMPLER_CHARS)
            if not self.sampler:
                raise ValueError("sampler must be a non-empty string or None, got ''")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {list(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.output_kind == "final" and self.num_previews:
            raise ValueError("num_previews needs output_kind='progress' (previews ride on progress outputs)")
        if self.output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {list(OUTPUT_TYPES)}, got {self.output_type!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or not -PRIORITY_LIMIT <= self.priority < PRIORITY_LIMIT:
            raise ValueError(f"priority must be an integer in [-2**31, 2**31), got {self.priority!r}")
        _optional_int("num_previews", self.num_previews, low=0)
        if self.deadline_s is not None and (isinstance(self.deadline_s, bool)
                                            or not isinstance(self.deadline_s, (int, float))
                                            or not 0 < self.deadline_s < float("inf")):
            raise ValueError(f"deadline_s must be a finite number of seconds > 0, got {self.deadline_s!r}")
        _optional_int("max_sequence_length", self.max_sequence_length, low=1)
        if not _is_default(self.cache):
            parse_cache(self.cache)
        _check_loras(self.loras)
        if self.eta is not None and (isinstance(self.eta, bool) or not isinstance(self.eta, (int, float))
                                     or not 0 <= self.eta <= 1):
            raise ValueError(f"eta must be a number in [0, 1], got {self.eta!r}")
        for name in ("aesthetic_score", "negative_aesthetic_score"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.strength is not None:
            if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                    or not 0 < self.strength <= 1:
                raise ValueError(f"strength must be in (0, 1], got {self.strength!r}")
            if self.image is None:
                raise ValueError("strength needs an image (image-to-image)")
        if self.mask_image is not None and self.image is None:
            raise ValueError("mask_image needs an image (inpainting repaints the image where the mask is white)")
        if isinstance(self.image, (list, tuple)) and not self.image:
            raise ValueError("image: an empty list of images")
        parse_controls(self.controls)
        check_ip_adapter_scale(self.ip_adapter_scale)

    def resolve(self, info: "ModelInfo", config: "EngineConfig") -> "SamplingParams":
        """A copy with every default filled from the model, checked against the engine's limits."""
        self.validate()
        max_pixels = info.pixel_limit(config.max_image_pixels)
        if self.negative_prompt is not None and len(self.negative_prompt) > config.max_prompt_chars:
            raise ValueError(f"negative_prompt must be at most {config.max_prompt_chars} characters, "
                             f"got {len(self.negative_prompt)}")
        for name in ("guidance_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is not None and value > config.max_guidance_scale:
                raise ValueError(f"{name} must be at most {config.max_guidance_scale} (max_guidance_scale), "
                                 f"got {value!r}")
        if self.guidance_scale_2 is not None and info.expert_boundary is None:
            raise ValueError(f"guidance_scale_2: this model ({info.pipeline_class}) has one denoiser; the scale "
                             "of a second expert is for two-expert models (Wan 2.2 A14B)")
        if self.eta is not None and info.schedule.eta is None:
            raise ValueError(f"eta: the {info.family} pipeline takes no eta")
        _check_aesthetic_scores(self, info)
        if info.video is None:
            given = next((name for name in ("num_frames", "fps") if getattr(self, name) is not None), None)
            if given:
                raise ValueError(f"{given}: this model ({info.pipeline_class}) makes images, not videos")
        _check_sequence_length(self.max_sequence_length, info)
        cache = check_served(parse_cache(config.default_cache if _is_default(self.cache) else self.cache), info)
        if self.strength is not None and not info.images.sets_start:
            raise ValueError(f"strength: {info.pipeline_class} conditions on its images; it takes no strength")
        image = load_images(self.image, info, max_pixels)
        mask = None if self.mask_image is None else load_mask(self.mask_image, image, info, max_pixels)
        if info.images.requires_mask and mask is None:
            raise ValueError(f"mask_image: this model ({info.pipeline_class}) only inpaints: send an image and a mask")
        controls = load_controls(self.controls, config, info, max_pixels)
        if controls and image is not None and not info.images.controls:
            raise ValueError(f"controls: {info.pipeline_class} takes controls with text-to-image only, not beside "
                             "input images")
        if controls and image is not None and any(c.mode is not None for c in controls):
            raise ValueError("controls: a union controlnet's controls (with a mode) are served with text-to-image "
                             "only, not beside input images")
        conditioned = "controls" if controls else "ip_adapter_image" if self.ip_adapter_image is not None else None
        if conditioned and cache is not None:  # the engine's default cache leaves such a request uncached
            if not _is_default(self.cache):
                raise ValueError(f"{conditioned}: not served with step caching (cache) yet; send cache null")
            cache = None
        image_h, image_w = control_size(controls[0].image, info.latents.size_factor) \
            if controls and image is None and info.images.control_sets_size else \
            default_size(info, image, mask is not None)
        guidance = info.defaults.guidance if self.guidance_scale is None else float(self.guidance_scale)
        default_strength = info.defaults.inpaint_strength if mask is not None else info.defaults.strength
        resolved = dataclasses.replace(
            self,
            num_inference_steps=self.num_inference_steps or info.defaults.steps,
            guidance_scale=guidance,
            guidance_scale_2=_guidance_2(self, info, guidance),
            height=self.height or image_h,
            width=self.width or image_w,
            seed=secrets.randbelow(RANDOM_SEED_LIMIT) if self.seed is None else self.seed,
            sampler=self.sampler or info.defaults.sampler,
            image=image,
            mask_image=mask,
            strength=None if image is None or not info.images.sets_start else
            (default_strength if self.strength is None else self.strength),
            eta=info.schedule.eta if self.eta is None else float(self.eta),
            max_sequence_length=self.max_sequence_length or info.text.max_sequence_length,
            cache=cache,
            loras={name: float(w) for name, w in sorted(self.loras.items())} if self.loras else None,
            num_frames=_frames(self.num_frames, info, config),
            fps=None if info.video is None else float(self.fps or info.video.fps),
            aesthetic_score=_score(self.aesthetic_score, AESTHETIC_SCORE, info),
            negative_aesthetic_score=_score(self.negative_aesthetic_score, NEGATIVE_AESTHETIC_SCORE, info),
            controls=controls, ip_adapter_image=load_image_prompt(self.ip_adapter_image, config, info, max_pixels),
        )
        if resolved.loras and not config.enable_lora:
            raise ValueError("loras: this engine serves no LoRA adapters (start it with enable_lora or lora_modules)")
        if resolved.loras and len(resolved.loras) > config.max_loras:
            raise ValueError(f"loras: {len(resolved.loras)} adapters in one request, but max_loras is "
                             f"{config.max_loras}")
        if resolved.num_inference_steps > config.max_inference_steps:
            raise ValueError(
                f"num_inference_steps must be in [1, {config.max_inference_steps}], got {resolved.num_inference_steps}"
            )
        # img2img sizes are multiples of the VAE's scale factor (its image processor rounds to them); others of
        # the size factor the pipeline checks
        factor = info.latents.scale if image is not None and mask is None and info.images.sets_start else \
            info.latents.size_factor
        for name in ("height", "width"):
            value = getattr(resolved, name)
            if value % factor:
                raise ValueError(f"{name} must be a positive multiple of {factor} for this model, got {value}")
        side = info.latents.max_side
        if side is not None and max(resolved.height, resolved.width) > side:
            raise ValueError(f"height and width must be at most {side} for this model (its position tables), got "
                             f"{resolved.height}x{resolved.width}")
        if resolved.height * resolved.width > max_pixels:
            raise ValueError(
                f"height*width must be at most {max_pixels} pixels (max_image_pixels), "
                f"got {resolved.height}x{resolved.width}"
            )
        if resolved.n > config.max_images_per_prompt:
            raise ValueError(f"n must be in [1, {config.max_images_per_prompt}], got {resolved.n}")
        return resolved


def _guidance_2(params: SamplingParams, info: "ModelInfo", guidance: float) -> float | None:
    """A two-expert model's low-noise scale (None for one expert): the request's; else, where the request names
    guidance_scale, that one, as the pipeline falls back; else the model's default, or its guidance default."""
    if info.expert_boundary is None:
        return None
    if params.guidance_scale_2 is not None:
        return float(params.guidance_scale_2)
    if params.guidance_scale is None and info.defaults.guidance_2 is not None:
        return float(info.defaults.guidance_2)
    return guidance


def _frames(frames: int | None, info: "ModelInfo", config: "EngineConfig") -> int | None:
    """A video request's frame count (the model's default if it names none); None for an image model."""
    video = info.video
    if video is None:
        return None
    frames = frames or video.frames
    if frames > config.max_num_frames:
        raise ValueError(f"num_frames must be at most {config.max_num_frames} (max_num_frames), got {frames}")
    if video.max_frames is not None and frames > video.max_frames:
        raise ValueError(f"num_frames must be at most {video.max_frames} for this model (its position tables), "
                         f"got {frames}")
    step = video.frame_multiple
    if (frames - 1) % step:
        lower = (frames - 1) // step * step + 1
        raise ValueError(f"num_frames - 1 must be a multiple of {step} for this model (its VAE keeps the first "
                         f"frame and packs each {step} after it into one): got {frames}; {lower} or {lower + step} "
                         "would do")
    return frames


def _check_aesthetic_scores(params: SamplingParams, info: "ModelInfo") -> None:
    given = [n for n in ("aesthetic_score", "negative_aesthetic_score") if getattr(params, n) is not None]
    if given and not info.images.aesthetic_scores:
        raise ValueError(f"{given[0]}: this model takes no aesthetic score (SDXL models trained with one do: "
                         "requires_aesthetics_score, e.g. the refiner)")
    if info.images.aesthetic_scores and params.image is None:
        raise ValueError("image: this model conditions on an aesthetic score (requires_aesthetics_score, e.g. the "
                         "SDXL refiner): it refines or inpaints an image; send one")


def _score(value: float | None, default: float, info: "ModelInfo") -> float | None:
    if not info.images.aesthetic_scores:
        return None
    return default if value is None else float(value)


def check_text(name: str, value: object, max_chars: int | None = None) -> None:
    """A text field: a string of valid Unicode (a lone surrogate cannot be encoded), bounded in length."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{name} must be at most {max_chars} characters, got {len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text: it has a lone surrogate at position {e.start}") from None


def _check_sequence_length(length: int | None, info: "ModelInfo") -> None:
    if length is None:
        return
    if info.text.sequence_length_range is None:
        raise ValueError(f"max_sequence_length: the {info.family} pipeline takes none")
    low, high = info.text.sequence_length_range
    if low == high and length != low:
        raise ValueError(f"max_sequence_length: the {info.family} family serves its pipeline's default, {low}, "
                         f"only (its text has no mask, so other lengths could not share a forward); got {length}")
    if not low <= length <= high:
        raise ValueError(f"max_sequence_length must be in [{low}, {high}] for the {info.family} family, got {length}")


def _check_loras(loras: Any) -> None:
    if loras is None:
        return
    if not isinstance(loras, dict):
        raise ValueError(f"loras must be an object of adapter name -> weight, got {type(loras).__name__}")
    if len(loras) > MAX_REQUEST_LORAS:
        raise ValueError(f"loras: at most {MAX_REQUEST_LORAS} adapters in one request, got {len(loras)}")
    for name, weight in loras.items():
        try:
            check_lora_name(name)  # what an adapter can be loaded as
            lora_weight(name, weight)
        except ValueError as e:
            raise ValueError(f"loras: {e}") from None


def lora_weight(name: str, weight: Any) -> float:
    """An adapter's weight as a float; ValueError unless a number within +-MAX_LORA_WEIGHT."""
    try:
        number = None if isinstance(weight, bool) else float(weight) if isinstance(weight, (int, float)) else None
    except OverflowError:  # an integer too large for a float
        number = None
    if number is None or not abs(number) <= MAX_LORA_WEIGHT:
        raise ValueError(f"the weight of {show_value(name)} must be a number in [-{MAX_LORA_WEIGHT:g}, "
                         f"{MAX_LORA_WEIGHT:g}], got {show_value(weight)}")
    return number


def _is_default(cache: Any) -> bool:
    return isinstance(cache, str) and cache == USE_DEFAULT


def _optional_int(name: str, value: object, low: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

