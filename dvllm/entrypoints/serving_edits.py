"""POST /v1/images/edits: OpenAI's multipart form, served as image-to-image.

The form's fields are the generation request's (strings, converted by their declared types;
the objects `cache` and `loras` as JSON text) plus the image file. A mask (inpainting) is
refused with a clear 400: dvllm serves image-to-image, not inpainting, so far.
"""
from __future__ import annotations

import io
import json
import re
import types
import typing
from typing import Any

from PIL import Image, UnidentifiedImageError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from dvllm.entrypoints.protocol import APIError, ImageEditRequest
from dvllm.entrypoints.serving_images import ServerContext, read_body, serve_request

_FILE_FIELDS = ("image", "image[]", "mask")
_JSON_FIELDS = ("cache", "loras")  # objects in a JSON body: JSON text in a form


async def create_edit(request: Request, ctx: ServerContext) -> Response:
    async def parse() -> ImageEditRequest:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            raise APIError(415, f"Content-Type must be multipart/form-data, got {content_type!r}.",
                           code="unsupported_media_type")
        request._body = await read_body(request, ctx.max_body_bytes)  # bounded, then parsed from memory
        try:
            form = await request.form(max_files=4, max_fields=64)
        except Exception as e:  # a malformed multipart body
            raise APIError(400, f"The request body is not a valid multipart form: {e}.", code="invalid_form") from None
        if form.get("mask") is not None:
            raise APIError(400, "mask (inpainting) is not supported yet; send the image without a mask.",
                           param="mask", code="unsupported_value")
        images = [v for key in ("image", "image[]") for v in form.getlist(key)]
        if len(images) != 1 or not isinstance(images[0], UploadFile):
            raise APIError(400, "Send exactly one image file as 'image'.", param="image", code="invalid_value")
        fields = {k: v for k, v in form.multi_items() if k not in _FILE_FIELDS}
        req = ImageEditRequest.parse(_typed(fields))
        info = ctx.engine.model_info
        req.image = _open(await images[0].read(), ctx.engine.config.image_pixel_limit(info.default_height,
                                                                                      info.default_width))
        return req

    return await serve_request(request, ctx, parse)


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """The upload, opened lazily: only its header is read here, on the event loop. Its size is checked
    before anything is decoded; the engine's input processor decodes it, off the loop, once the
    request is past the queue check."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise APIError(400, f"Invalid value for 'image': not a readable image ({e}).", param="image",
                       code="invalid_image") from None
    if image.width * image.height > max_pixels:
        raise APIError(400, f"Invalid value for 'image': {image.width}x{image.height} is over this server's "
                            f"limit of {max_pixels} pixels (max_image_pixels).", param="image", code="invalid_image")
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
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise APIError(400, f"Invalid value for '{key}': expected a JSON object or null, got {value[:80]!r}.",
                       param=key, code="invalid_value") from None


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
