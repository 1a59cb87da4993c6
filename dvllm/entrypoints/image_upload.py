"""An uploaded image, opened lazily: what the images, edits and videos endpoints read of one before the engine."""
from __future__ import annotations

import io

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
