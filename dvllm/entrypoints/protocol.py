"""The OpenAI Images API as dvllm speaks it: request and response bodies, and the error shape.

Requests are strict (no "5" for 5, no true for 1) so a typo'd type is a 400, not a guess.
Unknown fields are accepted and ignored, as vLLM does; the server logs them.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dvllm.sampling_params import PARAM_ALIASES, PRIORITY_LIMIT, SEED_LIMIT, SamplingParams
from dvllm.step_cache import USE_DEFAULT

MAX_PARTIAL_IMAGES = 3
MAX_NAME_CHARS = 256  # model, user, sampler: names, not texts (prompts are bounded by the engine)
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


_OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")



def long_names(body: Any, aliases: dict[str, str]) -> Any:
    """A body with its fields' short names (aliases: short -> long) replaced by the long ones; both given is
    a ValueError."""
    if not isinstance(body, dict) or not any(short in body for short in aliases):
        return body
    body = dict(body)
    for short, name in aliases.items():
        if short in body:
            if name in body:
                raise ValueError(f"{short!r} is short for {name!r}: give one of them")
            body[name] = body.pop(short)
    return body

class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = _OBJECT_ADDRESS.sub("", message)  # e.g. PIL's "<_io.BytesIO object at 0x7f...>"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def valid_unicode(value: Any) -> Any:
    """JSON may carry a lone surrogate ("\\ud800"), which no encoder, log, path or response can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it has a lone surrogate)") from None
    return value


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str = Field(min_length=1)  # its length is the engine's max_prompt_chars
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    n: int | None = Field(None, ge=1)
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the model's default)
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    stream: bool | None = None
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # OpenAI fields that do not apply to a diffusion model: accepted, ignored.
    quality: Any = None
    background: Any = None
    moderation: Any = None
    style: Any = None
    safety_identifier: Any = None
    complexity: Any = None
    # dvllm's own fields, in the same body (as vLLM's extensions are)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    sampler: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    priority: int | None = Field(None, ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)
    deadline: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds after arrival (deadline_s)
    eta: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # DDIM/TCD's, where the pipeline takes one
    max_sequence_length: int | None = Field(None, ge=1)  # the text encoder's, where the pipeline takes one
    # step caching: {"method": <a step_caches method>, ...}; absent: the server's default; null: none
    cache: dict[str, Any] | None = None
    # LoRA adapters loaded on the server, by name, with their weights: {"style": 0.8}. The weights are checked
    # by the engine, so its messages are the same whatever the entrypoint.
    loras: dict[str, Any] | None = None
    # SDXL models trained with an aesthetic score (the refiner): the prompt's and the negative rows' scores
    aesthetic_score: float | None = Field(None, allow_inf_nan=False)
    negative_aesthetic_score: float | None = Field(None, allow_inf_nan=False)
    # ControlNet: [{"name", "image" (base64 or a data: URL), "scale", "start", "end", "mode"}]; the images are
    # opened by the server (entrypoints/control_uploads.py), the rest checked by the engine (dvllm/controls.py)
    controls: list[Any] | None = None
    # IP-Adapter: an image prompt (base64 or a data: URL, opened by entrypoints/image_prompt_upload.py) and its scale
    ip_adapter_image: str | None = None
    ip_adapter_scale: float | None = Field(None, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return valid_unicode(value)

    @model_validator(mode="before")
    @classmethod
    def _short_names(cls, body: Any) -> Any:
        """"steps" and "guidance" (dvllm generate's names) mean num_inference_steps and guidance_scale."""
        return long_names(body, PARAM_ALIASES)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> "ImageGenerationRequest":
        """Validates a decoded JSON object; a bad field is an APIError 400 naming it in `param`."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None

    # The streamed events' type prefix (OpenAI names edits' events image_edit.*).
    event_prefix: ClassVar[str] = "image_generation"

    @property
    def image_count(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def format(self) -> str:
        return self.output_format or "png"

    def sampling_params(self) -> SamplingParams:
        height, width = parse_size(self.size)
        return SamplingParams(
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt, height=height, width=width, seed=self.seed,
            n=self.image_count, sampler=self.sampler, output_type="pil", priority=self.priority or 0,
            # previews cost a VAE decode each: only streaming shows them
            num_previews=(self.partial_images or 0) if self.stream else 0, eta=self.eta,
            output_kind="progress" if self.stream else "final",  # a plain request waits for its end only
            max_sequence_length=self.max_sequence_length,
            cache=self.cache if "cache" in self.model_fields_set else USE_DEFAULT,
            loras=self.loras, aesthetic_score=self.aesthetic_score,
            negative_aesthetic_score=self.negative_aesthetic_score, deadline_s=self.deadline, controls=self.controls,
            **({} if self.ip_adapter_scale is None else {"ip_adapter_scale": self.ip_adapter_scale}),
        )


_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")  # strict: ASCII digits, a lowercase x, nothing else


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """'WxH' -> (height, width); None or 'auto' -> the model's default (None, None)."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise APIError(400, f"Invalid value for 'size': expected 'WIDTHxHEIGHT' (e.g. 512x512) or 'auto', "
                            f"got {size!r}.", param="size", code="invalid_value")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise APIError(400, f"Invalid value for 'size': width and height must be >= 1, got {size!r}.",
                       param="size", code="invalid_value")
    return height, width


# What the engine's ValueError messages start with -> the request field to name in `param`.
_ENGINE_FIELDS = {"height": "size", "width": "size", "height*width": "size", "num_previews": "partial_images",
                  "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale", "n": "n",
                  "seed": "seed", "sampler": "sampler", "negative_prompt": "negative_prompt", "prompt": "prompt",
                  "priority": "priority", "image": "image", "strength": "strength", "eta": "eta",
                  "max_sequence_length": "max_sequence_length", "cache": "cache", "loras": "loras",
                  "mask_image": "mask", "aesthetic_score": "aesthetic_score",
                  "negative_aesthetic_score": "negative_aesthetic_score", "deadline_s": "deadline",
                  "num_frames": "num_frames", "fps": "fps", "ip_adapter_image": "ip_adapter_image",
                  "ip_adapter_scale": "ip_adapter_scale"}  # mask: the edits form's field


def engine_value_error(error: ValueError) -> APIError:
    """The engine's ValueErrors start with the field name ("height must be ..."): name it in `param`."""
    message = str(error)
    control = re.match(r"controls(\[[0-9]+\](\.[a-z]+)?)?", message)  # a control's own field, as the engine names it
    match = re.match(r"[A-Za-z_*]+", message)
    param = control.group(0) if control else _ENGINE_FIELDS.get(match.group(0)) if match else None
    return APIError(400, message, param=param, code="invalid_value")


def validation_error(e: ValidationError) -> APIError:
    first = e.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    return APIError(400, f"Invalid value for '{param}': {first['msg']}.", param=param, code="invalid_value")


# -- responses -------------------------------------------------------------------------------

class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    # With n > 1 every image has the request's seed: like diffusers' num_images_per_prompt, dvllm
    # draws the n images from one generator seeded once. Image `index` of a request is reproduced by
    # the same request (same seed and n) and taking its image `index`; alone, with n=1, only index 0 is.
    seed: int
    index: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    cached_steps: int | None = None  # dvllm's: steps step caching skipped (only for a request with a cache)


class UsageDetails(BaseModel):
    image_tokens: int = 0
    text_tokens: int = 0


class Usage(BaseModel):
    """Required by the streamed completed event's schema; dvllm counts no tokens, so all zeros."""

    input_tokens: int = 0
    input_tokens_details: UsageDetails = Field(default_factory=UsageDetails)
    output_tokens: int = 0
    total_tokens: int = 0


class _ImageEvent(BaseModel):
    b64_json: str
    background: str = "opaque"
    created_at: int
    output_format: str
    quality: str = "auto"
    size: str


class PartialImageEvent(_ImageEvent):
    type: str = "image_generation.partial_image"  # image_edit.partial_image for /v1/images/edits
    partial_image_index: int
    # dvllm's: the request's progress when the partial image was sent (steps done of num_steps), and the engine's
    # estimate of the seconds its remaining steps take (RequestOutput.eta_s)
    step: int | None = None
    num_steps: int | None = None
    eta_seconds: float | None = None


class CompletedEvent(_ImageEvent):
    type: str = "image_generation.completed"  # image_edit.completed for /v1/images/edits
    usage: Usage = Field(default_factory=Usage)
    seed: int
    cached_steps: int | None = None  # as ImagesResponse's


class ModelCard(BaseModel):
    """vLLM's shape: a LoRA adapter's card names its path as `root` and the base model as `parent`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dvllm"
    root: str | None = None
    parent: str | None = None
    # the served model's defaults, sizes and samplers (model_facts.py); an adapter's own defaults, if it has any
    dvllm: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageEditRequest(ImageGenerationRequest):
    """POST /v1/images/edits (multipart): the generation fields, the start image(s), an optional mask, and
    dvllm's strength."""

    event_prefix: ClassVar[str] = "image_edit"
    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    input_fidelity: Any = None  # OpenAI's; does not apply
    # attached after parsing: the uploaded image (PIL, opened lazily), or a list of them for models that take
    # several; and the mask, already converted to diffusers' grey mask (mask_upload.py)
    image: Any = Field(None, exclude=True)
    mask: Any = Field(None, exclude=True)

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        params.image, params.mask_image, params.strength = self.image, self.mask, self.strength
        return params


# -- runtime LoRA updates (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) ----------------

_Body = TypeVar("_Body", bound=BaseModel)


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter. Other fields (vLLM's lora_int_id) are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return valid_unicode(value)

    @classmethod
    def parse(cls: type[_Body], body: dict[str, Any]) -> _Body:
        """Validates a decoded JSON object; a bad field is an APIError 400 naming it in `param`."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None


class LoadLoraAdapterRequest(UnloadLoraAdapterRequest):
    """POST /v1/load_lora_adapter: a name for the adapter and its path on the server's disk."""

    lora_path: str = Field(min_length=1)
