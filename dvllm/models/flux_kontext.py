"""FLUX.1 Kontext: Flux conditioned on one input image, whose latents join the noisy ones in the sequence.

As FluxKontextPipeline: the image is resized to the preferred Kontext resolution closest to its aspect
(`_auto_resize`, always on here), its VAE latents (argmax: no random draw, so the noise is the pipeline's
first and only draw) are packed and follow the noisy latents in the transformer's sequence, at the
noisy latents' positions with the first id coordinate 1; the output is cut back to the noisy tokens.
The image latents are the request's private input state in the pool. The text encoding does not read
the image (prompt_reads_images is False): prompts share the prompt cache whatever their images.

The schedule's mu is the pipeline's: from the noisy latents' tokens only. Guidance is Flux's embedded
guidance (guidance_scale); the pipeline's optional true CFG (true_cfg_scale > 1 with a negative prompt)
is not served, as with Flux: a negative prompt is ignored, as the pipeline ignores it at its default
true_cfg_scale of 1. The output is the requested height x width exactly: the pipeline's call with
max_area=height*width (its default max_area rescales any requested size to about 1024x1024; a request
that names no size gets that default, 1024x1024, whatever the image).

Flux's transformer takes one set of positions (img_ids) for the whole batch, so rows whose input
images have other token grids (other preferred resolutions) run one transformer call per distinct
grid; rows of one grid share a call. Step caching is not served (the hidden stream carries the input
image's tokens, which the cache layout does not count).
"""
from __future__ import annotations

import dataclasses
from functools import cached_property, partial
from typing import Any

import torch

from dvllm.models.base import Conditions, HookContext
from dvllm.models.flux import FluxAdapter, latent_image_ids
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import ImageInputs, ModelInfo

DEFAULT_AREA = 1024 * 1024  # the pipeline's max_area: its default output is 1024x1024

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height), copied so the driver needs no diffusers
PREFERRED_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)


def input_size(multiple: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) the pipeline resizes an input image to: its size rounded down to `multiple` (the image
    processor's get_default_height_width) gives the aspect, the closest preferred resolution the size."""
    w, h = width - width % multiple, height - height % multiple
    if not w or not h:
        raise ValueError(f"image: each side must be at least {multiple} pixels for this model, got {width}x{height}")
    _, w, h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in PREFERRED_RESOLUTIONS)
    return w // multiple * multiple, h // multiple * multiple


def edit_size(multiple: int, sizes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(height, width) of a request that names none: the pipeline's default, 1024x1024 whatever the image."""
    side = round(DEFAULT_AREA ** 0.5) // multiple * multiple
    return side, side


def edit_grids(multiple: int, sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The input image's latent-token grid (rows, columns)."""
    grids = []
    for width, height in sizes:
        w, h = input_size(multiple, width, height)
        grids.append((h // multiple, w // multiple))
    return tuple(grids)


def edit_numel(multiple: int, features: int, height: int, width: int,
               sizes: tuple[tuple[int, int], ...] | None) -> int:
    """Numbers per image of the input state: the image's packed latents (None: the largest preferred resolution's)."""
    if sizes is None:
        return max((w // multiple) * (h // multiple) for w, h in PREFERRED_RESOLUTIONS) * features
    return sum(r * c for r, c in edit_grids(multiple, sizes)) * features


class FluxKontextAdapter(FluxAdapter):
    vae_follows_dtype = True
    pipeline_classes = ("FluxKontextPipeline",)
    controlnet_class = None  # diffusers has no Kontext ControlNet pipeline
    ip_adapter_kind = None  # (its pipeline takes one, but edits with image prompts are not checked against it yet)

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        multiple = pipe.vae_scale_factor * 2
        side = edit_size(multiple, ())[0]
        flux = FluxAdapter.info.func(self)
        return dataclasses.replace(
            flux, family="flux-kontext", defaults=dataclasses.replace(flux.defaults, height=side, width=side),
            images=ImageInputs(img2img=True, required=True, sets_start=False, max_images=1,
                               edit_size=partial(edit_size, multiple), edit_grids=partial(edit_grids, multiple),
                               edit_numel=partial(edit_numel, multiple, pipe.transformer.config.in_channels),
                               denoiser_takes_inputs=True),
            cache_layout=None,  # no step caching for the edit rows
        )

    def prepare_edit(self, images: tuple[Any, ...], n: int, height: int, width: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(start noise, [n, input numbers]) as the pipeline's prepare_latents makes them: the image resized and
        encoded (argmax: no draw), then the noise."""
        pipe = self.pipeline
        (image,) = images
        w, h = input_size(pipe.vae_scale_factor * 2, image.width, image.height)
        image = pipe.image_processor.resize(image, h, w)
        pixels = pipe.image_processor.preprocess(image, h, w)
        channels = pipe.transformer.config.in_channels // 4
        latents, image_latents, _, _ = pipe.prepare_latents(pixels, n, channels, height, width, self.dtype,
                                                            self.device, generator)
        return latents, image_latents.reshape(n, -1)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        """Rows of one input grid share a call; one call per distinct grid (see the module docstring)."""
        grids = [tuple(g[:2]) for g in layout.row_grids]

        def call(rows: list[int], index: Any) -> torch.Tensor:
            return self._call(latents[index], timesteps[index], {k: v[index] for k, v in conditions.items()},
                              guidance[index], layout.image_size, grids[rows[0]])

        return self.call_per_group(grids, latents, call, context)

    def _call(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions, guidance: torch.Tensor,
              image_size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
        pipe = self.pipeline
        rows, (tokens, features) = len(latents), latents.shape[1:]
        image_tokens = grid[0] * grid[1]
        image_latents = conditions["image_inputs"][:, :image_tokens * features].view(rows, image_tokens, features)
        multiple = pipe.vae_scale_factor * 2
        ids = latent_image_ids(image_size[0] // multiple, image_size[1] // multiple, self.device, latents.dtype)
        image_ids = latent_image_ids(grid[0], grid[1], self.device, latents.dtype, first=1)  # the input image's
        hidden = torch.cat([latents, image_latents.to(latents.dtype)], dim=1)
        out = self._forward(hidden, torch.cat([ids, image_ids]), timesteps, conditions, guidance)
        return out[:, :tokens]

    def graph_key(self, layout: BatchLayout) -> Any:
        return layout.image_size, layout.row_grids

    def cache_spec(self) -> None:
        return None
