"""The images a request carries, checked and loaded as SamplingParams.resolve takes them: its input image(s) and
mask, its ControlNet controls' images, its IP-Adapter image prompt; and the size a request without one gets from
them. Torch-free: the driver checks requests before anything heavy loads."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dvllm.controls import Control, parse_controls
from dvllm.request_sizes import image_sizes
from dvllm.sampler_names import did_you_mean

if TYPE_CHECKING:
    from dvllm.config import EngineConfig
    from dvllm.models.base import ModelInfo


def load_controls(value: Any, config: "EngineConfig", info: "ModelInfo", max_pixels: int) -> tuple[Control, ...] | None:
    """The request's controls, each naming a controlnet this engine loaded, with its image as an RGB PIL image."""
    controls = parse_controls(value)
    if not controls:
        return None
    served = config.controlnets or {}
    if not served:
        raise ValueError("controls: this engine serves no controlnets (start it with --controlnet NAME=PATH)")
    for i, control in enumerate(controls):
        if control.name not in served:
            raise ValueError(f"controls[{i}].name: no controlnet {control.name!r} is loaded; this engine serves "
                             f"{sorted(served)}{did_you_mean(control.name, served)}")
        if info.images.controls_one_controlnet and control.name != controls[0].name:
            raise ValueError(f"controls[{i}].name: the {info.family} family takes one controlnet a request (several "
                             f"images of it); controls[0] names {controls[0].name!r}, this one {control.name!r}")
        _check_mode(control, info.control_modes.get(control.name), f"controls[{i}].mode")
    return tuple(dataclasses.replace(c, image=load_image(c.image, info, max_pixels, f"controls[{i}].image",
                                                          input_image=False)) for i, c in enumerate(controls))


def load_image_prompt(value: Any, config: "EngineConfig", info: "ModelInfo", max_pixels: int) -> Any:
    """The request's IP-Adapter image prompt as an RGB PIL image (None: none)."""
    if value is None:
        return None
    if not config.ip_adapter:
        raise ValueError("ip_adapter_image: this engine serves no IP-Adapter (start it with --ip-adapter WEIGHTS)")
    return load_image(value, info, max_pixels, "ip_adapter_image", input_image=False)


def _check_mode(control: Control, modes: int | None, where: str) -> None:
    """A union controlnet's control names one of its `modes` (None: not a union controlnet, which takes none)."""
    if modes is None and control.mode is not None:
        raise ValueError(f"{where}: controlnet {control.name!r} is not a union controlnet; it takes no mode")
    if modes is not None and control.mode is None:
        raise ValueError(f"{where}: controlnet {control.name!r} is a union controlnet; a control on it names its "
                         f"mode, 0 to {modes - 1}")
    if modes is not None and control.mode >= modes:
        raise ValueError(f"{where} must be below {modes}, the control modes of {control.name!r}, got {control.mode}")


def control_size(image: Any, factor: int) -> tuple[int, int]:
    """(height, width) a request without a size takes from its first control image, as diffusers' ControlNet
    pipelines take it from the image they prepare: its own, rounded down to the model's size factor (the VAE's
    scale factor there, the same for SD's and SDXL's 8)."""
    height, width = image.height - image.height % factor, image.width - image.width % factor
    if not height or not width:
        raise ValueError(f"controls[0].image: {image.width}x{image.height} is smaller than the model's size factor "
                         f"({factor}x{factor}); send a larger image, or a height and width")
    return height, width


def default_size(info: "ModelInfo", image: Any, inpaint: bool) -> tuple[int, int]:
    """(height, width) of a request that names none. Text-to-image and inpainting: the model's default (the
    inpainting pipelines resize the image to it). Image-to-image: the image's size, rounded down to the VAE's
    scale factor as the img2img pipelines' image processor rounds it. Edit models: their own rule."""
    if image is None or inpaint:
        return info.defaults.height, info.defaults.width
    sizes = image_sizes(image)
    if info.images.edit_size is not None:
        return info.images.edit_size(sizes)
    factor = info.latents.scale
    (w, h), = sizes
    return h // factor * factor, w // factor * factor


def load_images(image: Any, info: "ModelInfo", max_pixels: int) -> Any:
    """One RGB PIL image, or a tuple of them for models that take several; None for none."""
    if image is None:
        if info.images.required:
            raise ValueError(f"image: this model ({info.pipeline_class}) "
                             f"{'animates an image' if info.video else 'edits images'}: send an image")
        return None
    if not isinstance(image, (list, tuple)):
        return load_image(image, info, max_pixels)
    if len(image) > info.images.max_images:
        raise ValueError(f"image: {len(image)} images, but this model takes at most {info.images.max_images}")
    if info.images.max_images == 1:
        return load_image(image[0], info, max_pixels)
    return tuple(load_image(i, info, max_pixels, f"image[{k}]") for k, i in enumerate(image))


def load_mask(mask: Any, image: Any, info: "ModelInfo", max_pixels: int) -> Any:
    """The mask as a PIL image of the image's size (kept as given: the pipeline's mask processor makes it grey)."""
    if not info.images.inpaint_channels:
        raise ValueError(f"mask_image: inpainting is not supported for the {info.family} family")
    if isinstance(image, tuple):
        raise ValueError("mask_image: inpainting takes one image, got several")
    mask = load_image(mask, info, max_pixels, "mask_image", mode=None).copy()
    if mask.size != image.size:
        raise ValueError(f"mask_image must be the size of image ({image.width}x{image.height}), "
                         f"got {mask.width}x{mask.height}")
    return mask


def load_image(image: Any, info: "ModelInfo", max_pixels: int, name: str = "image", mode: str | None = "RGB",
                input_image: bool = True) -> Any:
    """A PIL image (converted to `mode`) from what the caller gave; ValueError naming the field otherwise.
    `input_image`: one the model starts from (not a control image or an image prompt), which needs image-to-image."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if input_image and not info.images.img2img:
        raise ValueError(f"{name}: image-to-image is not supported for the {info.family} family")
    try:
        if isinstance(image, str):
            with Image.open(image) as f:
                _check_image_size(f, info, max_pixels)  # from the header, before decoding
                image = f.copy()
        elif isinstance(image, np.ndarray):
            grey = mode is None and image.ndim == 2  # a mask may be HxW
            if image.dtype != np.uint8 or not (grey or image.ndim == 3 and image.shape[2] == 3):
                raise ValueError(f"an array must be HxWx3{' or HxW' if mode is None else ''} uint8, "
                                 f"got {image.dtype} {image.shape}")
            image = Image.fromarray(image)
        elif not isinstance(image, Image.Image):
            raise ValueError(f"expected a PIL image, an HxWx3 uint8 array or a path, got {type(image).__name__}")
        _check_image_size(image, info, max_pixels)
        image.load()  # decodes a lazily opened file: its size is checked first
        return image.convert(mode) if mode is not None else image
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name}: cannot read it as an image: {e}") from None
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(name) else f"{name}: {e}") from None


def _check_image_size(image: Any, info: "ModelInfo", max_pixels: int) -> None:
    if image.width * image.height > max_pixels:
        raise ValueError(f"{image.width}x{image.height} is over max_image_pixels={max_pixels}")
    if min(image.width, image.height) < info.latents.size_factor:
        raise ValueError(f"{image.width}x{image.height} is smaller than {info.latents.size_factor} px on a side")
