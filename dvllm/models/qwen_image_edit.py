"""Qwen-Image-Edit and Qwen-Image-Edit Plus: Qwen-Image conditioned on input images twice over.

The Qwen2.5-VL encoder reads the prompt together with the images (resized as the pipeline resizes
them), so a prompt's conditions depend on its images: the prompt cache keys them by the images'
digest too. The images' VAE latents (argmax, no random draw) follow the noisy latents in the
transformer's sequence; they are the request's private input state in the pool, and the
denoiser's output is cut back to the noisy latents' tokens.

Rows whose input images differ in size (other token grids, other sequence lengths) share one
transformer call: their image tokens are padded to the longest row's and each row gets its own
rotary positions (qwen_rows.py), since the transformer itself takes one set of shapes per call.
Measured (benchmarks/README.md, "Edits of other input sizes"): padding rows of one image to rows of
two doubles their tokens and cost more than a second call saved, so rows share a padded call per
image count; within one count the VAE area is fixed (~1024^2) and padding costs a few percent.

Plus (several images) encodes each image at about 384x384 for the VL encoder and 1024x1024 for the
VAE; Edit encodes one image at about 1024x1024 for both. Step caching is not served here (the
hidden stream carries the input images' tokens, which the cache layout does not count).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from functools import cached_property, partial
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from dvllm.host_copy import device_tensor
from dvllm.models.base import Conditions, HookContext
from dvllm.models.byte_tokenizer import allow_qwen_vl_processor_without_torchvision
from dvllm.models.flux import flux_timestep_kwargs
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text
from dvllm.models.qwen_image import MAX_TEXT_TOKENS, QwenImageAdapter
from dvllm.models.qwen_rows import RowShapeHooks, RowShapes

VAE_AREA = 1024 * 1024        # both pipelines' VAE image area (Edit's VL image too)
PLUS_CONDITION_AREA = 384 * 384  # Plus's VL image area
MAX_PLUS_IMAGES = 3  # Qwen-Image-Edit-2509 is made for one to three images; the pool is sized for that many
VL_PATCH = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 make one token


def target_size(area: int, width: int, height: int) -> tuple[int, int]:
    """The pipelines' calculate_dimensions: (width, height) of about `area` pixels, the aspect kept, multiples of 32."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def edit_size(plus: bool, multiple: int, sizes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(height, width) of a request that names none: the VAE size of Edit's image (Plus's last), rounded down."""
    w, h = target_size(VAE_AREA, *(sizes[-1] if plus else sizes[0]))
    return h // multiple * multiple, w // multiple * multiple


def edit_grids(vae_scale: int, sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Each input image's latent-token grid (rows, columns) in the transformer's sequence."""
    grids = []
    for w, h in sizes:
        vw, vh = target_size(VAE_AREA, w, h)
        grids.append((vh // vae_scale // 2, vw // vae_scale // 2))
    return tuple(grids)


def edit_numel(vae_scale: int, features: int, max_images: int, height: int, width: int,
               sizes: tuple[tuple[int, int], ...] | None) -> int:
    """Numbers per image of the request's input state: its images' packed latents (None: the most there can be)."""
    if sizes is None:  # calculate_dimensions keeps the area within a few percent of VAE_AREA
        return max_images * int(1.1 * VAE_AREA / (vae_scale * 2) ** 2) * features
    return sum(r * c for r, c in edit_grids(vae_scale, sizes)) * features


class QwenImageEditAdapter(QwenImageAdapter):
    pipeline_classes = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    controlnet_class = None  # diffusers has no ControlNet edit pipeline
    _row_hooks: RowShapeHooks | None = None  # installed with the first call that pads rows

    @classmethod
    def before_loading(cls) -> None:
        allow_qwen_vl_processor_without_torchvision()  # its processor loads without torchvision only so

    @property
    def plus(self) -> bool:
        return type(self.pipeline).__name__ == "QwenImageEditPlusPipeline"

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        hidden = pipe.text_encoder.config.text_config.hidden_size
        images = MAX_PLUS_IMAGES if self.plus else 1
        length = self.max_text_tokens
        features = pipe.transformer.config.in_channels
        return ModelInfo(
            family="qwen-image-edit", pipeline_class=type(pipe).__name__,
            # num_inference_steps and true_cfg_scale; the size is never used: every request brings an image
            defaults=Defaults(steps=50, guidance=4.0, height=1024, width=1024),
            schedule=Schedule(self.scheduler_config(), timestep_kwargs=partial(flux_timestep_kwargs, factor)),
            latents=Latents(channels=pipe.transformer.config.in_channels // 4, scale=factor, size_factor=factor * 2,
                            patch=2),
            text=Text({"prompt_embeds": (length, hidden), "prompt_embeds_mask": (length,)}, reads_images=True),
            guidance=Guidance(needs_negative_prompt=True),
            images=ImageInputs(img2img=True, required=True, sets_start=False, max_images=images,
                               edit_size=partial(edit_size, self.plus, factor * 2),
                               edit_grids=partial(edit_grids, factor),
                               edit_numel=partial(edit_numel, factor, features, images), denoiser_takes_inputs=True),
        )

    @property
    def max_text_tokens(self) -> int:
        """The longest prompt conditions the pool holds: the pipeline's 1024 text tokens plus every image's VL
        tokens at their area (with a margin for the rounding to 28-pixel patches at any aspect)."""
        area, count = (PLUS_CONDITION_AREA, MAX_PLUS_IMAGES) if self.plus else (VAE_AREA, 1)
        return MAX_TEXT_TOKENS + count * int(1.25 * area / VL_PATCH ** 2)

    # -- the prompt, read with the images ----------------------------------------------------------
    def encode_prompt(self, texts: list[tuple[str | None, bool]], max_sequence_length: int | None = None,
                      images: Any = None) -> list[Conditions]:
        """One pipeline encode per text (Plus numbers its pictures per call, so texts cannot share one)."""
        if images is None:
            raise ValueError(f"{self.info.pipeline_class} reads every prompt with its images")
        vl_images = self._vl_images(images)
        length = self.max_text_tokens
        out = []
        for text, _ in texts:
            embeds, mask = self.pipeline.encode_prompt(prompt=[text or ""], image=vl_images, device=self.encoder_device)
            if embeds.shape[1] > length:
                raise ValueError(f"the prompt with its images is {embeds.shape[1]} tokens; this model holds at most "
                                 f"{length} (shorten the prompt)")
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            pad = length - embeds.shape[1]
            out.append({"prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
                        "prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad)).to(embeds.dtype)})
        return out

    def _vl_images(self, images: tuple[Any, ...]) -> Any:
        """What the pipeline gives the VL encoder: Edit's image at its VAE size; Plus's each at ~384x384."""
        resize = self.pipeline.image_processor.resize
        if not self.plus:
            w, h = target_size(VAE_AREA, images[0].width, images[0].height)
            return resize(images[0], h, w)
        return [resize(image, h, w) for image in images
                for w, h in [target_size(PLUS_CONDITION_AREA, image.width, image.height)]]

    # -- latents and the images' latents ----------------------------------------------------------
    def prepare_edit(self, images: tuple[Any, ...], n: int, height: int, width: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(start noise, [n, input numbers]): the noise as the pipeline draws it; the images' packed VAE latents
        (argmax: no draw) one after another, the same for each of the n images."""
        pipe, channels = self.pipeline, self.pipeline.transformer.config.in_channels // 4
        scale = pipe.vae_scale_factor
        packed = []
        for image in images:
            w, h = target_size(VAE_AREA, image.width, image.height)
            if not self.plus:  # Edit resizes first and preprocesses the resized image
                image = pipe.image_processor.resize(image, h, w)
            pixels = pipe.image_processor.preprocess(image, h, w).unsqueeze(2).to(self.device, pipe.vae.dtype)
            latents = pipe._encode_vae_image(image=pixels, generator=generator).to(self.dtype)
            packed.append(pipe._pack_latents(latents, 1, channels, *latents.shape[3:]).reshape(1, -1))
        h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
        noise = randn_tensor((n, 1, channels, h, w), generator=generator, device=self.device, dtype=self.dtype)
        noise = pipe._pack_latents(noise, n, channels, h, w)
        return noise, torch.cat(packed, dim=1).expand(n, -1)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        """Rows with as many input images share one call, padded to the longest (see the module docstring)."""
        grids, lengths = layout.row_grids, layout.row_text_lengths
        # zero_cond_t modulates tokens by their image's place, which padding would shift: a call per shape set
        keys = grids if self.pipeline.transformer.zero_cond_t else [sum(1 for x in g[::2] if x) for g in grids]

        def call(rows: list[int], index: Any) -> torch.Tensor:
            return self._call(latents[index], timesteps[index], {k: v[index] for k, v in conditions.items()},
                              [self._shapes(grids[i], layout.image_size) for i in rows], [lengths[i] for i in rows],
                              padded=len({grids[i] for i in rows}) > 1)

        return self.call_per_group(keys, latents, call, context)

    def padded_denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                       layout: BatchLayout) -> torch.Tensor:
        """Every row in one call, whatever its image count (benchmarks/README.md: padded against grouped)."""
        return self._call(latents, timesteps, conditions, [self._shapes(g, layout.image_size) for g in layout.row_grids],
                          list(layout.row_text_lengths), padded=True)

    def graph_key(self, layout: BatchLayout) -> Any:
        lengths = layout.row_text_lengths
        return layout.image_size, layout.row_grids, max(lengths), min(lengths) == max(lengths)

    def _shapes(self, grids: tuple[int, ...], image_size: tuple[int, int]) -> list[tuple[int, int, int]]:
        """The transformer's img_shapes of one row: its output's token grid, then each input image's."""
        scale = self.pipeline.vae_scale_factor
        images = [(1, grids[i], grids[i + 1]) for i in range(0, len(grids), 2) if grids[i]]
        return [(1, image_size[0] // scale // 2, image_size[1] // scale // 2), *images]

    def _call(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
              shapes: list[list[tuple[int, int, int]]], lengths: list[int], padded: bool = False) -> torch.Tensor:
        pipe = self.pipeline
        tokens, features = latents.shape[1], latents.shape[2]
        # each row's image tokens, padded to the longest row's (all equal unless `padded`)
        image_tokens = [sum(r * c for _, r, c in row[1:]) for row in shapes]
        longest = max(image_tokens)
        image_latents = conditions["image_inputs"][:, :longest * features].view(len(latents), longest, features)
        length = max(lengths)  # the call's longest prompt: the rest is padding
        mask, embeds = conditions["prompt_embeds_mask"][:, :length] > 0.5, conditions["prompt_embeds"][:, :length]
        text_mask = None if min(lengths) == length else mask.long()
        rows = nullcontext()
        if padded:
            real = torch.arange(tokens + longest, device=latents.device)[None] < \
                device_tensor([tokens + t for t in image_tokens], latents.device)[:, None]
            rows = self._row_shape_hooks().running(RowShapes(shapes, tokens + longest, real))
        with rows:
            out = pipe.transformer(
                hidden_states=torch.cat([latents, image_latents.to(latents.dtype)], dim=1),
                timestep=timesteps.to(latents.dtype) / 1000, guidance=None, encoder_hidden_states_mask=text_mask,
                encoder_hidden_states=embeds, img_shapes=shapes, return_dict=False,
            )[0]
        return out[:, :tokens]

    def _row_shape_hooks(self) -> RowShapeHooks:
        """The transformer's per-row positions and attention, hooked in with the first call that pads rows."""
        if self._row_hooks is None:
            self._row_hooks = RowShapeHooks(self.pipeline.transformer)
        return self._row_hooks

    def cache_spec(self) -> None:
        return None
