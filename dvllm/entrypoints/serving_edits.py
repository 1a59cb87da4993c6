"""POST /v1/images/edits: OpenAI's multipart form, served as image-to-image, or as inpainting with a mask.

The form's fields are the generation request's (strings, converted by their declared types;
the objects `cache` and `loras` as JSON text) plus the files: one image, or several (`image[]`, in the
order sent) for models that take several (`model_info.images.max_images`), and an optional `mask`.

The mask follows OpenAI: a PNG of the image's size whose transparent pixels mark where to edit. With an
alpha channel (RGBA, LA, or a palette or grey PNG with transparency info) the grey mask diffusers gets is
`255 - alpha`, so after diffusers' 0.5 binarization a pixel is repainted where alpha < 128 (fully
transparent: edited; opaque: kept). A mask without alpha is taken as diffusers takes it: made grey, white =
repaint (dvllm's extension). The image's own alpha is not a mask: without a mask an edit is image-to-image.
Only the uploads' headers are read on the event loop (their sizes are checked first); the mask is decoded
and converted in a worker thread (mask_upload.py), the images by the engine's input processor.
"""
from __future__ import annotations

import asyncio
import io
import json
import re
import types
import typing
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from dvllm.entrypoints.mask_upload import mask_from_upload
from dvllm.entrypoints.protocol import APIError, ImageEditRequest
from dvllm.entrypoints.request_body import read_body
from dvllm.entrypoints.serving_images import ServerContext, serve_request

if TYPE_CHECKING:
    from dvllm.models.base import ModelInfo

_IMAGE_FIELDS = ("image", "image[]")
_FILE_FIELDS = (*_IMAGE_FIELDS, "mask")
_JSON_FIELDS = ("cache", "loras")  # objects in a JSON body: JSON text in a form
_MAX_FILES = 64  # however many images a model takes: each file part costs a spooled file while parsing


async def create_edit(request: Request, ctx: ServerContext) -> Response:
    async def parse() -> ImageEditRequest:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            raise APIError(415, f"Content-Type must be multipart/form-data, got {content_type!r}.",
                           code="unsupported_media_type")
        request._body = await read_body(request, ctx.body_limits)  # bounded, then parsed from memory
        info = ctx.engine.model_info
        try:  # room for the images the model takes, a mask, and one file more, which _check_files names
            form = await request.form(max_files=min(info.images.max_images + 2, _MAX_FILES), max_fields=64)
        except Exception as e:  # a malformed multipart body, or too many files
            if "Too many files" in str(getattr(e, "detail", e)):
                raise _too_many_images(info, "too many files;") from None
            raise APIError(400, f"The request body is not a valid multipart form: {e}.", code="invalid_form") from None
        images = [value for key, value in form.multi_items() if key in _IMAGE_FIELDS]  # in the order sent
        masks = form.getlist("mask")
        _check_files(images, masks, info)
        fields = {k: v for k, v in form.multi_items() if k not in _FILE_FIELDS}
        req = ImageEditRequest.parse(_typed(fields))
        max_pixels = ctx.engine.config.pixel_limit(info)
        opened = [_open(await image.read(), max_pixels) for image in images]
        req.image = opened[0] if len(opened) == 1 else opened
        if masks:
            req.mask = await _mask(await masks[0].read(), opened[0], max_pixels)
        return req

    return await serve_request(request, ctx, parse)


def _check_files(images: list[Any], masks: list[Any], info: ModelInfo) -> None:
    """The file parts, counted and typed before any is read."""
    if not images or not all(isinstance(image, UploadFile) for image in images):
        takes = "an image file" if info.images.max_images == 1 else f"1 to {info.images.max_images} image files"
        raise APIError(400, f"Send {takes} as 'image' (several as 'image[]').", param="image", code="invalid_value")
    if len(images) > info.images.max_images:
        raise _too_many_images(info, f"{len(images)} images, but")
    if not masks:
        return
    if len(masks) > 1 or not isinstance(masks[0], UploadFile):
        raise APIError(400, "Invalid value for 'mask': send one image file.", param="mask", code="invalid_value")
    if not info.images.inpaint_channels:  # said before the engine's image-to-image refusal, which would name 'image'
        raise APIError(400, f"Invalid value for 'mask': inpainting is not supported for the {info.family} family; "
                            "send the image without a mask.", param="mask", code="unsupported_value")


def _too_many_images(info: ModelInfo, what: str) -> APIError:
    plural = "image" if info.images.max_images == 1 else "images"
    return APIError(400, f"Invalid value for 'image': {what} this model takes at most {info.images.max_images} "
                         f"{plural} (and one mask).", param="image", code="invalid_value")


async def _mask(data: bytes, image: Image.Image, max_pixels: int) -> Image.Image:
    """The upload as diffusers' grey mask: its header checked here, decoded and converted in a thread."""
    mask = _open(data, max_pixels, "mask")
    if mask.size != image.size:
        raise APIError(400, f"Invalid value for 'mask': {mask.width}x{mask.height}, but the image is "
                            f"{image.width}x{image.height}; the mask must have the image's size.", param="mask",
                       code="invalid_image")
    return await asyncio.to_thread(_convert_mask, mask)


def _convert_mask(mask: Image.Image) -> Image.Image:
    try:
        return mask_from_upload(mask)
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # e.g. a truncated PNG
        raise APIError(400, f"Invalid value for 'mask': not a readable image ({e}).", param="mask",
                       code="invalid_image") from None


def _open(data: bytes, max_pixels: int, param: str = "image") -> Image.Image:
    """The upload, opened lazily: only its header is read here, on the event loop. Its size is checked
    before anything is decoded; an image is decoded by the engine's input processor, off the loop, once
    the request is past the queue check (a mask by _mask, in a thread)."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise APIError(400, f"Invalid value for '{param}': not a readable image ({e}).", param=param,
                       code="invalid_image") from None
    if image.width * image.height > max_pixels:
        raise APIError(400, f"Invalid value for '{param}': {image.width}x{image.height} is over this server's "
                            f"limit of {max_pixels} pixels (max_image_pixels).", param=param, code="invalid_image")
    return image


def _typed(fields: dict[str, Any]) -> dict[str, Any]:
    """Form values are strings: convert those the request declares as numbers or booleans."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(ImageEditRequest)
    for key, value in fields.items():
        if key in _JSON_FIELDS and isinstance(value, str):
            out[key] = _parse_json_field(key, value)
            continue
        kind = _base_type(hints.get(key))
        if not isinstance(value, str) or kind not in (int, float, bool):
            out[key] = value
            continue
        try:
            out[key] = _parse(value, kind)
        except ValueError:
            raise APIError(400, f"Invalid value for '{key}': expected {kind.__name__}, got {value!r}.",
                           param=key, code="invalid_value") from None
    return out


def _parse_json_field(key: str, value: str) -> Any:
    try:  # as a JSON body is read: NaN and Infinity are no JSON; 5000 digits or 10**5 brackets are ValueErrors too
        return json.loads(value, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise APIError(400, f"Invalid value for '{key}': expected a JSON object or null, got {value[:80]!r}.",
                       param=key, code="invalid_value") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _base_type(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return hint


_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # JSON's number syntax


def _parse(value: str, kind: type) -> Any:
    """Strictly, as JSON would: no "1_000", no spaces, no full-width digits, no "inf"."""
    if kind is bool:
        if value.lower() not in ("true", "false"):  # clients write Python's True too
            raise ValueError(value)
        return value.lower() == "true"
    if not (_INT if kind is int else _FLOAT).fullmatch(value):
        raise ValueError(value)
    return kind(value)
