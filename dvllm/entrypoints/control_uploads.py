"""An images request's `controls` as JSON carries them: each image a base64 string (or a data: URL), opened
lazily here (its header read, its size checked against the server's pixel limit); the engine's input processor
decodes and prepares it at admission, off the event loop. The body's own size limit bounds the bytes."""
from __future__ import annotations

import base64
import binascii
from typing import Any

from dvllm.controls import MAX_CONTROLS
from dvllm.entrypoints.protocol import APIError
from dvllm.entrypoints.image_upload import open_image


def open_controls(controls: list[Any] | None, max_pixels: int) -> list[dict[str, Any]] | None:
    """The controls with their images opened; APIError 400 naming the control's field otherwise."""
    if controls is None:
        return None
    if len(controls) > MAX_CONTROLS:  # (the model's own limit: checked again by the engine)
        raise APIError(400, f"Invalid value for 'controls': at most {MAX_CONTROLS} controls, got {len(controls)}.",
                       param="controls", code="invalid_value")
    opened = []
    for i, control in enumerate(controls):
        if not isinstance(control, dict):
            raise APIError(400, f"Invalid value for 'controls[{i}]': expected an object {{name, image, scale, "
                                "start, end}.", param=f"controls[{i}]", code="invalid_value")
        opened.append(dict(control, image=_open(control.get("image"), max_pixels, f"controls[{i}].image")))
    return opened


def _open(image: Any, max_pixels: int, param: str) -> Any:
    if not isinstance(image, str) or not image:
        raise APIError(400, f"Invalid value for '{param}': send the control image as a base64 string or a "
                            "data:image/...;base64 URL (this server fetches no URLs).", param=param,
                       code="invalid_value")
    data = image.split(";base64,", 1)[1] if image.startswith("data:") else image
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"Invalid value for '{param}': not valid base64.", param=param,
                       code="invalid_value") from None
    return open_image(raw, max_pixels, param)
