"""Wan image-to-video (WanImageToVideoPipeline: Wan 2.1 I2V with its CLIP image encoder, Wan 2.2 I2V A14B
without one): every request brings one image, which becomes the video's first frame.

The image leaves per video a condition the transformer reads beside the latents at every step: the VAE's
encoding of [image, black frames] with a mask of which frames are given (mask channels, one per frame a
latent frame packs, then the VAE's channels), and the image encoder's penultimate hidden states where the
pipeline has one. Both are the request's private input state in the pool, flattened in that order, and the
transformer gets them as the pipeline passes them: concatenated to the latents' channels, and as
encoder_hidden_states_image. A request that names no size gets the model's default area at its image's
aspect ratio, in multiples of the size factor, as diffusers' Wan I2V examples size it.

Wan 2.2 TI2V (expand_timesteps) conditions no channel: its image is the video's first latent frame, and the
image is optional. WanAdapter serves it, as it does the same checkpoint under WanPipeline (models/wan_ti2v.py).
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property, partial
from typing import Any

import torch

from dvllm.models.base import Conditions
from dvllm.models.model_info import ImageInputs, ModelInfo, latent_frames
from dvllm.models.wan import WanAdapter
from dvllm.request_sizes import aspect_size


def condition_numel(mask_channels: int, channels: int, scale: int, temporal: int, embed_numel: int,
                    height: int, width: int, frames: int) -> int:
    """Numbers per video of an image's condition: mask and encoded frames, then the image embedding."""
    return (mask_channels + channels) * latent_frames(frames, temporal) * (height // scale) * (width // scale) \
        + embed_numel


class WanImageToVideoAdapter(WanAdapter):
    pipeline_classes = ("WanImageToVideoPipeline",)

    @cached_property
    def info(self) -> ModelInfo:
        info, pipe = super().info, self.pipeline
        if pipe.config.expand_timesteps:  # TI2V: WanAdapter's rule
            return info
        latents = info.latents
        embed = self._embed_shape()
        images = ImageInputs(
            img2img=True, required=True, sets_start=False, denoiser_takes_inputs=True, max_images=1,
            edit_size=partial(aspect_size, info.defaults.height * info.defaults.width, latents.size_factor),
            video_numel=partial(condition_numel, pipe.vae_scale_factor_temporal, latents.channels, latents.scale,
                                latents.temporal_scale, math.prod(embed) if embed else 0))
        return dataclasses.replace(info, pipeline_class=type(pipe).__name__, images=images)

    def _embed_shape(self) -> tuple[int, int] | None:
        """The image encoder's hidden states (tokens, width) for one image; None without an encoder."""
        pipe = self.pipeline
        if pipe.image_encoder is None or pipe.transformer.config.image_dim is None:
            return None
        config = pipe.image_encoder.config
        return (config.image_size // config.patch_size) ** 2 + 1, config.hidden_size  # the class token too

    def prepare_image_to_video(self, image: Any, n: int, height: int, width: int, frames: int,
                               generator: torch.Generator, init_noise_sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        pipe = self.pipeline
        if pipe.config.expand_timesteps:
            return super().prepare_image_to_video(image, n, height, width, frames, generator, init_noise_sigma)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        # the noise is the generator's first draw, as in the pipeline (the encoders draw nothing)
        latents, condition = pipe.prepare_latents(pixels, n, pipe.vae.config.z_dim, height, width, frames,
                                                  torch.float32, self.device, generator)
        state = [condition.flatten(1)]
        if self._embed_shape() is not None:
            state.append(pipe.encode_image(image, self.device).flatten(1).expand(n, -1))
        return latents * init_noise_sigma, torch.cat(state, dim=1).to(self.state_dtype)

    def transformer_inputs(self, latents: torch.Tensor, conditions: Conditions
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.pipeline.config.expand_timesteps:  # TI2V reads no input state: the first frame is in the latents
            return latents, {}
        rows, state = len(latents), conditions["image_inputs"]
        mask_and_frames = (self.pipeline.vae_scale_factor_temporal + latents.shape[1], *latents.shape[2:])
        split = math.prod(mask_and_frames)
        hidden = torch.cat([latents, state[:, :split].view(rows, *mask_and_frames)], dim=1)
        embed = self._embed_shape()
        return hidden, {} if embed is None else {"encoder_hidden_states_image": state[:, split:].view(rows, *embed)}

