"""POST /v1/videos' body as OpenAI's client sends it (a multipart form) or as JSON: VideoGenerationRequest, and
how it is read (bounded as every body is), its form values typed as the edits form's are.

The clip's length is OpenAI's `seconds` or dvllm's `num_frames`: seconds become frames_for_seconds(seconds, fps)
at the request's fps, else the model's.
"""
from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.datastructures import UploadFile
from starlette.requests import Request

from dvllm.entrypoints.form_fields import typed_form
from dvllm.entrypoints.protocol import MAX_NAME_CHARS, APIError, long_names, parse_size, valid_unicode, validation_error
from dvllm.entrypoints.request_body import BodyLimits, read_body, read_json_body
from dvllm.entrypoints.image_upload import open_image
from dvllm.sampling_params import PARAM_ALIASES, PRIORITY_LIMIT, SEED_LIMIT, SamplingParams
from dvllm.step_cache import USE_DEFAULT
from dvllm.video.mp4 import MAX_CRF

REFERENCE = "input_reference"

MAX_VIDEO_SECONDS = 3600.0  # far past any model's frames; bounds seconds * fps before the engine's max_num_frames
VIDEO_PARAM_ALIASES = {**PARAM_ALIASES, "frames": "num_frames"}


def frames_for_seconds(seconds: float, fps: float, frame_multiple: int) -> int:
    """The frame count nearest seconds * fps among those the model makes (1 + k * frame_multiple, k >= 0);
    a tie goes to the longer clip. E.g. 5 s at 16 fps (80 frames), multiple 4: 81."""
    k = max(0, math.floor((seconds * fps - 1) / frame_multiple + 0.5))
    return 1 + k * frame_multiple


class VideoGenerationRequest(BaseModel):
    """POST /v1/videos, a JSON body or a multipart form (as OpenAI's client sends it): OpenAI's fields, and dvllm's
    as for images. The clip's length is `seconds` (OpenAI's, a string or a number: frames_for_seconds at the
    request's fps, else the model's) or `num_frames` (dvllm's, "frames" for short), not both."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str = Field(min_length=1)
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    seconds: str | float | None = None  # a positive number once validated
    size: str | None = None  # "WIDTHxHEIGHT" or "auto"
    # image-to-video: a file in a form, OpenAI's {"image_url": "data:..."} in JSON; attached after parsing
    input_reference: Any = Field(None, exclude=True)
    # dvllm's own fields
    num_frames: int | None = Field(None, ge=1)
    fps: float | None = Field(None, gt=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    sampler: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    priority: int | None = Field(None, ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)
    deadline: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds after arrival (deadline_s)
    max_sequence_length: int | None = Field(None, ge=1)
    cache: dict[str, Any] | None = None
    loras: dict[str, Any] | None = None
    crf: int | None = Field(None, ge=0, le=MAX_CRF)  # the MP4's x264 quality: 0 lossless .. 51 (default 18)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return valid_unicode(value)

    @field_validator("seconds")
    @classmethod
    def _positive_seconds(cls, value: str | float | None) -> float | None:
        if isinstance(value, str):
            if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
                raise ValueError(f"expected a number of seconds, got {value[:40]!r}")
            value = float(value)
        if value is not None and not 0 < value <= MAX_VIDEO_SECONDS:
            raise ValueError(f"must be a number of seconds in (0, {MAX_VIDEO_SECONDS:g}]")
        return value

    @model_validator(mode="before")
    @classmethod
    def _short_names(cls, body: Any) -> Any:
        """"steps", "guidance" and "frames" mean num_inference_steps, guidance_scale and num_frames."""
        return long_names(body, VIDEO_PARAM_ALIASES)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> "VideoGenerationRequest":
        """Validates a decoded body; a bad field is an APIError 400 naming it in `param`."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None

    def sampling_params(self, default_fps: float, frame_multiple: int) -> SamplingParams:
        """One video, its frames from num_frames or seconds (the model's default for neither)."""
        if self.seconds is not None and self.num_frames is not None:
            raise APIError(400, "Give the clip's length as 'seconds' or as 'num_frames' (frames), not both.",
                           param="seconds", code="invalid_value")
        frames = self.num_frames
        if self.seconds is not None:
            frames = frames_for_seconds(float(self.seconds), self.fps or default_fps, frame_multiple)
        height, width = parse_size(self.size)
        return SamplingParams(
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt, height=height, width=width, seed=self.seed, sampler=self.sampler,
            output_type="np", priority=self.priority or 0, output_kind="progress",  # progress: the job's percent
            max_sequence_length=self.max_sequence_length,
            cache=self.cache if "cache" in self.model_fields_set else USE_DEFAULT, loras=self.loras,
            deadline_s=self.deadline, num_frames=frames, fps=self.fps, image=self.input_reference,
        )


# -- the request body: JSON, or a multipart form -----------------------------------------------------

async def read_video_request(request: Request, limits: BodyLimits, max_pixels: int) -> VideoGenerationRequest:
    """The body, JSON or a form, checked field by field; an input_reference image is opened lazily (its size
    checked from its header, up to max_pixels), as an edit's image is."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        if content_type.split(";")[0].strip().lower() != "application/json":
            got = repr(content_type) if content_type else "none"
            raise APIError(415, f"Content-Type must be application/json or multipart/form-data, got {got}.",
                           code="unsupported_media_type")
        req = VideoGenerationRequest.parse(await read_json_body(request, limits))
        if req.input_reference is not None:
            req.input_reference = _reference_from_json(req.input_reference, max_pixels)
        return req
    request._body = await read_body(request, limits)  # bounded, then parsed from memory
    try:
        form = await request.form(max_files=2, max_fields=64)
    except Exception as e:  # a malformed multipart body, or too many files
        raise APIError(400, f"The request body is not a valid multipart form: {getattr(e, 'detail', e)}.",
                       code="invalid_form") from None
    files = form.getlist(REFERENCE)
    # OpenAI's client sends {"image_url": ...} as the form fields input_reference[image_url]
    reference = {k[len(REFERENCE) + 1:-1]: v for k, v in form.multi_items() if k.startswith(REFERENCE + "[")}
    fields = {k: v for k, v in form.multi_items() if not k.startswith(REFERENCE)}
    req = VideoGenerationRequest.parse(typed_form(fields, VideoGenerationRequest, VIDEO_PARAM_ALIASES))
    if files:
        if len(files) > 1 or not isinstance(files[0], UploadFile):
            raise APIError(400, f"Invalid value for '{REFERENCE}': send one image file.", param=REFERENCE,
                           code="invalid_value")
        req.input_reference = open_image(await files[0].read(), max_pixels, REFERENCE)
    elif reference:
        req.input_reference = _reference_from_json(reference, max_pixels)
    return req


def _reference_from_json(reference: Any, max_pixels: int) -> Any:
    """OpenAI's {"image_url": "data:image/...;base64,..."}; this server fetches no URLs and keeps no files."""
    url = reference.get("image_url") if isinstance(reference, dict) else None
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise APIError(400, f"Invalid value for '{REFERENCE}': send an image file in a multipart form, or "
                            "{\"image_url\": \"data:image/png;base64,...\"} (this server fetches no URLs and "
                            "keeps no file ids).", param=REFERENCE, code="invalid_value")
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"Invalid value for '{REFERENCE}': its data URL is not valid base64.", param=REFERENCE,
                       code="invalid_value") from None
    return open_image(data, max_pixels, REFERENCE)
