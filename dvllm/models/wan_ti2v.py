"""Wan 2.2 TI2V (the 5B model, `expand_timesteps`): text- and image-to-video in one model.

Its image-to-video (WanImageToVideoPipeline's expand_timesteps branch) adds no input channel: the image's VAE
latents are the video's first latent frame. Each step the pipeline gives the transformer (1 - mask) * image +
mask * latents, the first frame's tokens at timestep 0 (mask * t per token); it steps its latents unmasked and
masks them once more at the end. A sampler's update is elementwise (Wan's schedulers run no thresholding,
which would read the whole sample), so no other frame ever reads the first frame's value: here the image's latents are written over the first frame at the start and after every step
(worker/first_frame.py), which gives every forward the pipeline's input and the video its final latents. The
image's latents are the request's input state. A request without an image is text-to-video, every token at
the row's timestep, as WanPipeline runs the same checkpoint; both kinds of row share a forward.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import ImageInputs, Latents, ModelInfo
from dvllm.request_sizes import aspect_size


def first_frame_numel(channels: int, scale: int, height: int, width: int, frames: int) -> int:
    """Numbers per video of its image's latents: one latent frame."""
    return channels * (height // scale) * (width // scale)


def first_frame_inputs(info: ModelInfo) -> ImageInputs:
    """What a TI2V request may bring: one image, optional (without it, text-to-video), no strength; a request
    that names no size gets the default area at the image's aspect ratio, as Wan image-to-video does."""
    latents = info.latents
    return ImageInputs(img2img=True, sets_start=False, max_images=1, first_frame=True,
                       edit_size=partial(aspect_size, info.defaults.height * info.defaults.width, latents.size_factor),
                       video_numel=partial(first_frame_numel, latents.channels, latents.scale))


def prepare_first_frame(pipe: Any, image: Any, n: int, height: int, width: int, frames: int,
                        generator: torch.Generator, init_noise_sigma: float, device: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(start latents with the image's latents as their first frame, [n, numbers] of those latents). Drawn and
    encoded by WanImageToVideoPipeline's own prepare_latents, whichever Wan pipeline holds the checkpoint (the
    5B ships as WanPipeline; its model card runs image-to-video as WanImageToVideoPipeline on the same files)."""
    from diffusers import WanImageToVideoPipeline

    pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
    latents, image_latents, mask = WanImageToVideoPipeline.prepare_latents(
        pipe, pixels, n, pipe.vae.config.z_dim, height, width, frames, torch.float32, device, generator)
    return (1 - mask) * image_latents + mask * (latents * init_noise_sigma), image_latents.flatten(1)


def timestep_mask(layout: BatchLayout, latents: Latents, patch: tuple[int, int, int]) -> torch.Tensor:
    """[rows, tokens] float32: 0 on the first latent frame's tokens of a row whose first frame is given, 1
    elsewhere; the pipeline's mask, which times the step's timestep gives each token's."""
    shape = latents.shape(*layout.image_size)
    per_frame = (shape[2] // patch[1]) * (shape[3] // patch[2])
    mask = torch.ones((layout.num_rows, shape[1] // patch[0] * per_frame), dtype=torch.float32)
    if layout.first_frames:
        given = torch.tensor(layout.per_row(layout.first_frames), dtype=torch.float32)
        mask[:, :per_frame] = (1 - given)[:, None]
    return mask
