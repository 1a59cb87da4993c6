"""SD3 / SD3.5: MMDiT transformer, CLIP x2 + T5 encoders, flow matching with shift.
ControlNet: SD3ControlNetModels, as StableDiffusion3ControlNetPipeline runs them (worker/sd3_controlnet.py)."""
from __future__ import annotations

from functools import cached_property, partial
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from dvllm.models.base import CacheSpec, Conditions, HookContext, ModelAdapter, transformer_cache_spec
from dvllm.models.flow_common import dynamic_shift_mu, image_seq_len
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, ImageInputs, Latents, ModelInfo, Schedule, Text

MAX_SEQUENCE_LENGTH = 256  # the pipeline's default T5 length
CONTROL_SAMPLE_SEED = 0x5D3C  # mixed into a request's seed for its control images' VAE samples


def sd3_timestep_kwargs(vae_scale: int, patch: int, height: int, width: int, num_steps: int,
                        config: dict[str, Any]) -> dict[str, Any]:
    """As StableDiffusion3Pipeline: a shift `mu` from the image size only with dynamic shifting."""
    if not config.get("use_dynamic_shifting"):
        return {}
    return {"mu": dynamic_shift_mu(config, image_seq_len(height, width, vae_scale, patch))}


class StableDiffusion3Adapter(ModelAdapter):
    pipeline_classes = ("StableDiffusion3Pipeline",)
    load_kwargs: dict[str, Any] = {}
    half_dtype = torch.bfloat16  # its pipelines' documented dtype
    controlnet_class = "SD3ControlNetModel"  # StableDiffusion3ControlNetPipeline's (InstantX's, Stability's 2B)
    # The T5 length the pipeline is called with. Without a T5 encoder the pipeline appends this many zero
    # tokens to the CLIP tokens, so a model trained without T5 may set its own (dvllm_defaults.json's
    # "max_sequence_length", through set_max_sequence_length).
    max_sequence_length: int = MAX_SEQUENCE_LENGTH

    def set_max_sequence_length(self, length: int, source: str = "max_sequence_length") -> None:
        """Serve `length` text tokens instead of the pipeline's default: only for a pipeline without T5,
        whose extra tokens are zeros the model was trained with. Must come before `info` is used."""
        if self.pipeline.text_encoder_3 is not None:
            raise ValueError(f"{source}: this stable-diffusion-3 model has a T5 encoder (text_encoder_3), whose "
                             f"length stays the pipeline's default, {MAX_SEQUENCE_LENGTH}; only a model without "
                             f"T5 may set its own")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"{source}: must be a positive integer, got {length!r}")
        self.max_sequence_length = length
        self.__dict__.pop("info", None)  # computed from the length: recomputed on next use

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor, patch = pipe.vae_scale_factor, pipe.patch_size
        shapes = self.probe_condition_shapes()
        side = pipe.default_sample_size * factor
        return ModelInfo(
            family="stable-diffusion-3", pipeline_class=type(pipe).__name__,
            defaults=Defaults(steps=28, guidance=7.0, height=side, width=side),
            schedule=Schedule(self.scheduler_config(), timestep_kwargs=partial(sd3_timestep_kwargs, factor, patch)),
            latents=Latents(channels=pipe.transformer.config.in_channels, scale=factor, size_factor=factor * patch),
            text=Text(shapes, max_sequence_length=self.max_sequence_length,
                      sequence_length_range=(self.max_sequence_length, self.max_sequence_length)),
            # the ControlNet pipeline sizes a request as the plain one, and VAE-encodes its control images
            images=ImageInputs(control_sets_size=False, control_input_is_image=False),
            cache_layout=self.cache_layout(self._cache_spec(shapes["prompt_embeds"][0])),
        )

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        # A missing negative prompt is "", encoded like any prompt (as the pipeline does).
        prompts = [text or "" for text, _ in texts]
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompts, None, None, device=self.encoder_device, num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds.split(1), pooled.split(1))]

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        shape = (n, *self.latent_shape(height, width))
        return randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype) * init_noise_sigma

    def control_input(self, image: torch.Tensor, controlnet: Any, n: int, generator: torch.Generator,
                      first: Any) -> torch.Tensor:
        """As StableDiffusion3ControlNetPipeline: the image normalized to [-1, 1], VAE-encoded, a sample of its
        latent distribution per image, shifted (not where the request's first controlnet is InstantX's,
        force_zeros_for_pooled_projection: the pipeline reads that one's config for all) and scaled. The pipeline draws that sample from torch's global RNG, not the request's generator, so its
        image is not a function of the seed; here it comes from a generator of its own, seeded from the request's
        seed, so that the request's start noise is the pipeline's and its images repeat ([n, C, h, w])."""
        vae = self.pipeline.vae
        own = torch.Generator("cpu").manual_seed(generator.initial_seed() ^ CONTROL_SAMPLE_SEED)
        pixels = (2.0 * image - 1.0).repeat_interleave(n, dim=0).to(self.device, vae.dtype)
        latents = vae.encode(pixels).latent_dist.sample(own)
        shift = 0.0 if first.config.force_zeros_for_pooled_projection else vae.config.shift_factor
        return ((latents - shift) * vae.config.scaling_factor).to(controlnet.dtype)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        return self.pipeline.transformer(
            hidden_states=latents, timestep=timesteps, encoder_hidden_states=conditions["prompt_embeds"],
            pooled_projections=conditions["pooled_prompt_embeds"], return_dict=False,
        )[0]

    def cache_spec(self) -> CacheSpec:
        return self._cache_spec(self.info.text.condition_shapes["prompt_embeds"][0])

    def _cache_spec(self, text_tokens: int) -> CacheSpec:
        # diffusers has no enable_cache for SD3: dvllm applies the same rules to its joint blocks. The
        # pipeline batches a request's CFG rows in one call, so they take one decision together.
        t = self.pipeline.transformer
        return transformer_cache_spec(
            list(t.transformer_blocks), [(b.attn, ("image", "text")) for b in t.transformer_blocks],
            inner_dim=t.config.num_attention_heads * t.config.attention_head_dim,
            pixels_per_token=self.pipeline.vae_scale_factor * self.pipeline.patch_size, dtype=self.dtype,
            text_tokens=text_tokens)

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        config = self.pipeline.vae.config
        latents = latents.to(self.pipeline.vae.dtype)
        image = self.pipeline.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pt")
