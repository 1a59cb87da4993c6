"""Flux: CLIP (pooled) + T5, packed latents with position ids, distilled guidance as an embedding.

Flux-dev embeds the guidance scale; there are no unconditional rows (the pipeline's
optional "true CFG" is not served, with or without controls). The schedule depends on the image size (mu).
ControlNet: FluxControlNetModels, as FluxControlNetPipeline runs them (worker/flux_controlnet.py).
"""
from __future__ import annotations

from functools import cached_property, partial
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux_controlnet import retrieve_latents

from dvllm.models.base import CacheSpec, Conditions, HookContext, ModelAdapter, transformer_cache_spec
from dvllm.models.flow_common import dynamic_shift_mu, image_seq_len, linear_sigmas
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text

MAX_SEQUENCE_LENGTH = 512  # the pipeline's default T5 length


def flux_timestep_kwargs(vae_scale: int, height: int, width: int, num_steps: int,
                         config: dict[str, Any]) -> dict[str, Any]:
    """As FluxPipeline: sigmas from 1 to 1/steps (unless the scheduler makes its own) and a size-dependent mu."""
    kwargs: dict[str, Any] = {"mu": dynamic_shift_mu(config, image_seq_len(height, width, vae_scale, 2))}
    if not config.get("use_flow_sigmas"):
        kwargs["sigmas"] = linear_sigmas(num_steps)
    return kwargs


def latent_image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype,
                     first: float = 0) -> torch.Tensor:
    """[height * width, 3] positions (first, row, column) of a token grid, row-major: FluxPipeline's
    _prepare_latent_image_ids (float32, then cast to dtype) with the first coordinate `first`, made on `device`:
    the pipeline's is made on the host and copied, a blocking copy. Made each step, not cached: a few small
    kernels, which a CUDA graph captures with the forward, and no memory that grows with the sizes clients ask."""
    ids = torch.zeros(height, width, 3, device=device)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(height * width, 3).to(dtype)


class FluxAdapter(ModelAdapter):
    pipeline_classes = ("FluxPipeline",)
    load_kwargs: dict[str, Any] = {}
    half_dtype = torch.bfloat16  # its pipelines' documented dtype
    controlnet_class = "FluxControlNetModel"  # FluxControlNetPipeline's (InstantX's and XLabs' checkpoints)
    ip_adapter_kind = "flux"  # FluxIPAdapterMixin

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        side = pipe.default_sample_size * factor
        return ModelInfo(
            family="flux", pipeline_class=type(pipe).__name__,
            defaults=Defaults(steps=28, guidance=3.5, height=side, width=side),
            schedule=Schedule(self.scheduler_config(), timestep_kwargs=partial(flux_timestep_kwargs, factor)),
            # latents are packed in 2x2 patches
            latents=Latents(channels=pipe.transformer.config.in_channels // 4, scale=factor, size_factor=factor * 2,
                            patch=2),
            text=Text(self.probe_condition_shapes(), max_sequence_length=MAX_SEQUENCE_LENGTH,
                      sequence_length_range=(MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH)),
            guidance=Guidance(supported=False),  # the guidance scale is embedded
            # FluxControlNetPipeline sizes a request as FluxPipeline, and encodes its control images with its generator
            images=ImageInputs(control_sets_size=False, control_input_is_image=False),
            cache_layout=self.cache_layout(),
        )

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        prompts = [text or "" for text, _ in texts]
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompts, None, device=self.encoder_device, num_images_per_prompt=1, max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        return [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds.split(1), pooled.split(1))]

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        channels = self.pipeline.transformer.config.in_channels // 4
        latents, _ = self.pipeline.prepare_latents(n, channels, height, width, self.dtype, self.device, generator)
        return latents * init_noise_sigma

    def control_input(self, image: torch.Tensor, controlnet: Any, n: int, generator: torch.Generator,
                      first: Any) -> torch.Tensor:
        """As FluxControlNetPipeline: the image normalized to [-1, 1] (its image processor normalizes); for a
        controlnet without an input_hint_block (InstantX's), repeated for the n images and VAE-encoded, a sample
        drawn from `generator` ([n, tokens, 4 * channels] packed latents); else the image itself."""
        image = 2.0 * image - 1.0
        if controlnet.input_hint_block is not None:
            return image.to(self.device, controlnet.dtype)
        pipe, vae = self.pipeline, self.pipeline.vae
        pixels = image.repeat_interleave(n, dim=0).to(self.device, vae.dtype)
        latents = retrieve_latents(vae.encode(pixels), generator=generator)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        packed = pipe._pack_latents(latents, n, latents.shape[1], latents.shape[2], latents.shape[3])
        return packed.to(controlnet.dtype)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        pipe = self.pipeline
        height, width = (2 * (s // (pipe.vae_scale_factor * 2)) for s in layout.image_size)
        img_ids = latent_image_ids(height // 2, width // 2, self.device, latents.dtype)
        return self._forward(latents, img_ids, timesteps, conditions, guidance)

    def _forward(self, hidden: torch.Tensor, img_ids: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                 guidance: torch.Tensor) -> torch.Tensor:
        """One transformer call on the image tokens `hidden` at positions `img_ids` ([tokens, 3], the whole batch's)."""
        pipe = self.pipeline
        embeds = conditions["prompt_embeds"]
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype)
        return pipe.transformer(
            hidden_states=hidden,
            timestep=timesteps.to(hidden.dtype) / 1000,
            guidance=guidance.float() if pipe.transformer.config.guidance_embeds else None,
            pooled_projections=conditions["pooled_prompt_embeds"], encoder_hidden_states=embeds,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]

    def cache_spec(self) -> CacheSpec:
        # Flux's cache state per row at 1024x1024 (4096 image tokens, 512 text, width 3072) in bfloat16:
        # first_block keeps 2 x 4096 x 3072 = 25.2M elements, 48 MiB, against 0.5 MiB of latents, so a
        # pool holds about 1/100 as many cached rows as plain ones (an 80 GiB pool: ~1700 rows, not 160k);
        # mag keeps one such residual, 24 MiB;
        # taylorseer (max_order 1) keeps two factors of 57 attention outputs of 4608 tokens: 1.6G elements,
        # 3.0 GiB a row, so a 40 GiB pool holds 13 such rows.
        t = self.pipeline.transformer
        config = t.config
        attention = [(b.attn, ("image", "text")) for b in t.transformer_blocks]
        attention += [(b.attn, ("joint",)) for b in t.single_transformer_blocks]
        return transformer_cache_spec(
            [*t.transformer_blocks, *t.single_transformer_blocks], attention,
            inner_dim=config.num_attention_heads * config.attention_head_dim,
            pixels_per_token=self.pipeline.vae_scale_factor * 2, dtype=self.dtype, text_tokens=MAX_SEQUENCE_LENGTH)

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        pipe = self.pipeline
        latents = pipe._unpack_latents(latents, image_size[0], image_size[1], pipe.vae_scale_factor)
        config = pipe.vae.config
        latents = latents.to(pipe.vae.dtype)
        image = pipe.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt")
