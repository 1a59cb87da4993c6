"""OpenAI's edit mask -> the mask diffusers' inpainting pipelines take. Shared by /v1/images/edits and
`dvllm generate --mask`, so a mask file means the same whichever way it is sent.

OpenAI marks where to edit with transparency: fully transparent pixels are edited, opaque ones kept.
diffusers takes a grey mask, white = repaint, binarized at 0.5 (grey >= 128 is repainted). So a mask with
an alpha channel (RGBA, LA, PA, or any mode with PNG transparency info) becomes `255 - alpha` per pixel:
repainted exactly where alpha < 128. A mask without alpha is taken as diffusers takes it (made grey,
white = repaint): dvllm's extension, for masks drawn the diffusers way.
"""
from __future__ import annotations

from PIL import Image, ImageChops


def has_alpha(image: Image.Image) -> bool:
    """Whether the image carries transparency: an alpha band, or PNG/GIF transparency info (a palette's
    or a grey/RGB colour's, which PIL turns into alpha on conversion)."""
    bands = image.getbands()
    return "A" in bands or "a" in bands or "transparency" in image.info


def mask_from_upload(image: Image.Image) -> Image.Image:
    """The grey ("L") mask diffusers gets for an uploaded mask: `255 - alpha` when it has alpha, else the
    image made grey as diffusers makes it (`convert("L")`). Decodes the image: call it off the event loop,
    after its size is checked from the header."""
    if has_alpha(image):
        return ImageChops.invert(image.convert("RGBA").getchannel("A"))
    return image.convert("L")
