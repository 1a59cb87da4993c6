"""An images request's IP-Adapter image prompt as JSON carries it: a base64 string (or a data: URL), opened
lazily here (its header read, its size checked against the server's pixel limit); the engine's input processor
decodes it at admission, off the event loop. The body's own size limit bounds the bytes."""
from __future__ import annotations

import base64
import binascii
from typing import Any

from dvllm.entrypoints.image_upload import open_image
from dvllm.entrypoints.protocol import APIError

PARAM = "ip_adapter_image"


def open_image_prompt(image: Any, max_pixels: int) -> Any:
    """The image prompt opened; APIError 400 naming ip_adapter_image otherwise."""
    if not isinstance(image, str) or not image:
        raise APIError(400, f"Invalid value for '{PARAM}': send the image as a base64 string or a "
                            "data:image/...;base64 URL (this server fetches no URLs).", param=PARAM,
                       code="invalid_value")
    data = image.split(";base64,", 1)[1] if image.startswith("data:") else image
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"Invalid value for '{PARAM}': not valid base64.", param=PARAM,
                       code="invalid_value") from None
    return open_image(raw, max_pixels, PARAM)
