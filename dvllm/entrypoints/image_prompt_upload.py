"""An images request's IP-Adapter image prompt as JSON carries it: a base64 string (or a data: URL), opened
lazily here (its header read, its size checked against the server's pixel limit); the engine's input processor
decodes it at admission, off the event loop. The body's own size limit bounds the bytes."""
from __future__ import annotations

from typing import Any

from dvllm.entrypoints.image_upload import open_base64_image

PARAM = "ip_adapter_image"


def open_image_prompt(image: Any, max_pixels: int) -> Any:
    """The image prompt opened; APIError 400 naming ip_adapter_image otherwise."""
    return open_base64_image(image, max_pixels, PARAM)
