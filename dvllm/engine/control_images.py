"""A request's control images made ready at admission, as diffusers' ControlNet pipelines prepare them
(`prepare_image`: the control image processor's resize to the request's size, RGB in [0, 1], no normalization),
so the worker only copies them to the device. Bounded like every input image: SamplingParams.resolve refused
images past max_image_pixels before this runs."""
from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
from diffusers.image_processor import VaeImageProcessor

from dvllm.controls import Control


def prepare_controls(controls: tuple[Control, ...] | None, height: int, width: int,
                     vae_scale_factor: int) -> tuple[Control, ...]:
    """Each control with its image as a [1, 3, height, width] float32 tensor."""
    if not controls:
        return ()
    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    return tuple(dataclasses.replace(c, image=processor.preprocess(c.image, height=height, width=width)
                                     .to(torch.float32)) for c in controls)


def control_key(image: torch.Tensor) -> bytes:
    """What identifies a prepared control image in the pool's shared entries: its shape and numbers (requests
    that send the same picture at the same size share one copy)."""
    digest = hashlib.blake2b(b"control", digest_size=16)
    digest.update(repr(tuple(image.shape)).encode())
    digest.update(image.contiguous().numpy().tobytes())
    return digest.digest()


def control_numel(height: int, width: int) -> int:
    """Numbers a prepared control image keeps in the pool."""
    return math.prod((3, height, width))
