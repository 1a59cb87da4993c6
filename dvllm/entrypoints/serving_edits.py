"""POST /v1/images/edits: OpenAI's multipart form, served as image-to-image, or as inpainting with a mask.

The form's fields are the generation request's (strings, converted by their declared types;
the objects `cache`, `loras` and `controls` as JSON text) plus the files: one image, or several (`image[]`, in the
order sent) for models that take several (`model_info.images.max_images`), an optional `mask`, and the images of
the controls that carry none in their JSON (`control_image[]`, in the order of those controls).

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
from typing import TYPE_CHECKING, Any

from PIL import Image
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from dvllm.controls import MAX_CONTROLS
from dvllm.entrypoints.control_uploads import attach_control_files
from dvllm.entrypoints.form_fields import typed_form
from dvllm.entrypoints.image_upload import open_image
from dvllm.entrypoints.mask_upload import mask_from_upload
from dvllm.entrypoints.protocol import APIError, ImageEditRequest
from dvllm.entrypoints.request_body import read_body
from dvllm.entrypoints.serving_images import ServerContext, serve_request

if TYPE_CHECKING:
    from dvllm.models.base import ModelInfo

_IMAGE_FIELDS = ("image", "image[]")
_CONTROL_FIELDS = ("control_image", "control_image[]")  # files for the controls that carry no image, in order
_FILE_FIELDS = (*_IMAGE_FIELDS, "mask", *_CONTROL_FIELDS)
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
            controls = MAX_CONTROLS if getattr(ctx.engine.config, "controlnets", None) else 0  # (files for them)
            form = await request.form(max_files=min(info.images.max_images + 2 + controls, _MAX_FILES), max_fields=64)
        except Exception as e:  # a malformed multipart body, or too many files
            if "Too many files" in str(getattr(e, "detail", e)):
                raise _too_many_images(info, "too many files;") from None
            raise APIError(400, f"The request body is not a valid multipart form: {e}.", code="invalid_form") from None
        images = [value for key, value in form.multi_items() if key in _IMAGE_FIELDS]  # in the order sent
        masks = form.getlist("mask")
        _check_files(images, masks, info)
        fields = {k: v for k, v in form.multi_items() if k not in _FILE_FIELDS}
        req = ImageEditRequest.parse(typed_form(fields, ImageEditRequest))
        max_pixels = info.pixel_limit(ctx.engine.config.max_image_pixels)
        opened = [open_image(await image.read(), max_pixels) for image in images]
        req.image = opened[0] if len(opened) == 1 else opened
        if masks:
            req.mask = await _mask(await masks[0].read(), opened[0], max_pixels)
        control_files = [value for key, value in form.multi_items() if key in _CONTROL_FIELDS]
        if not all(isinstance(f, UploadFile) for f in control_files):
            raise APIError(400, "Invalid value for 'control_image': send image files.", param="control_image",
                           code="invalid_value")
        req.controls = attach_control_files(req.controls, [open_image(await f.read(), max_pixels,
                                                                      f"control_image[{i}]")
                                                           for i, f in enumerate(control_files)])
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
    mask = open_image(data, max_pixels, "mask")
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


