"""An images request's `controls` as JSON carries them: each image a base64 string (or a data: URL), opened
lazily here (its header read, its size checked against the server's pixel limit); the engine's input processor
decodes and prepares it at admission, off the event loop. The body's own size limit bounds the bytes. In an edit's
multipart form, `controls` is JSON text, and a control without an image takes the next `control_image[]` file
(attach_control_files)."""
from __future__ import annotations

from typing import Any

from PIL import Image

from dvllm.controls import MAX_CONTROLS
from dvllm.entrypoints.protocol import APIError
from dvllm.entrypoints.image_upload import open_base64_image


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
                                "start, end, mode}.", param=f"controls[{i}]", code="invalid_value")
        opened.append(dict(control, image=_open(control.get("image"), max_pixels, f"controls[{i}].image")))
    return opened


def attach_control_files(controls: Any, files: list[Image.Image]) -> Any:
    """The form's controls with the uploaded control images (opened, in the order sent) given, in order, to the
    controls that carry no image of their own; APIError 400 naming `control_image` when the counts differ."""
    missing = [i for i, c in enumerate(controls or []) if isinstance(c, dict) and c.get("image") is None]
    if not files and not missing:
        return controls
    if len(files) != len(missing):
        raise APIError(400, f"Invalid value for 'control_image': {len(files)} control image file(s) for "
                            f"{len(missing)} control(s) without an image; send one file per such control, in order.",
                       param="control_image", code="invalid_value")
    controls = list(controls)
    for i, image in zip(missing, files):
        controls[i] = dict(controls[i], image=image)
    return controls


def _open(image: Any, max_pixels: int, param: str) -> Any:
    if isinstance(image, Image.Image):  # an edit form's file, opened and bounded already
        return image
    return open_base64_image(image, max_pixels, param, "control image")
