"""An uploaded image, opened lazily: what the images, edits and videos endpoints read of one before the engine."""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from dvllm.entrypoints.protocol import APIError


def open_image(data: bytes, max_pixels: int, param: str = "image") -> Image.Image:
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


def open_base64_image(value: Any, max_pixels: int, param: str, what: str = "image") -> Image.Image:
    """A JSON body's image: a base64 string or a data: URL, opened as open_image opens an upload; APIError 400
    naming `param` otherwise."""
    if not isinstance(value, str) or not value:
        raise APIError(400, f"Invalid value for '{param}': send the {what} as a base64 string or a "
                            "data:image/...;base64 URL (this server fetches no URLs).", param=param,
                       code="invalid_value")
    data = value.split(";base64,", 1)[1] if value.startswith("data:") else value
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"Invalid value for '{param}': not valid base64.", param=param,
                       code="invalid_value") from None
    return open_image(raw, max_pixels, param)
