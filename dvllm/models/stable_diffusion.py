"""Stable Diffusion 1.x / 2.x: UNet2DConditionModel, CLIP text encoder, epsilon or v-prediction."""
from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from dvllm.models.base import Conditions, ModelAdapter, ModelInfo


class StableDiffusionAdapter(ModelAdapter):
    pipeline_classes = ("StableDiffusionPipeline",)
    load_kwargs = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    family = "stable-diffusion"
    default_guidance = 7.5  # the pipeline's __call__ defaults
    default_strength = 0.8  # StableDiffusionImg2ImgPipeline's

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        default_size = pipe.unet.config.sample_size * factor
        return ModelInfo(
            name=self.name,
            family=self.family,
            pipeline_class=type(pipe).__name__,
            scheduler_config=self.scheduler_config(),
            default_steps=50,
            default_guidance=self.default_guidance,
            default_height=default_size,
            default_width=default_size,
            size_factor=max(8, factor),  # the pipeline's check_inputs wants multiples of 8
            latent_channels=pipe.unet.config.in_channels,
            latent_scale=factor,
            condition_shapes=self.probe_condition_shapes(),
            # LCM-distilled UNets embed the guidance scale instead of running CFG rows.
            supports_cfg=pipe.unet.config.time_cond_proj_dim is None,
            supports_img2img=True, default_strength=self.default_strength,
            step_kwargs=("eta", "generator"), default_eta=0.0,  # prepare_extra_step_kwargs, __call__'s eta=0.0
        )

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        # An absent negative prompt is the empty string, as in the pipeline. Every text is
        # padded to the tokenizer's max length, so one batched pass equals separate ones.
        prompts = [text or "" for text, _ in texts]
        embeds, _ = self.pipeline.encode_prompt(
            prompts, self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return [{"prompt_embeds": e} for e in embeds.split(1)]

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        shape = (n, *self.latent_shape(height, width))
        return randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype) * init_noise_sigma

    def encode_image(self, image: Any, n: int, height: int, width: int, generator: torch.Generator,
                     start_noise: tuple[float, float]) -> torch.Tensor:
        # As the img2img pipeline's prepare_latents: a VAE sample (drawn from the request's generator),
        # scaled, repeated for n images, then noised to the start step with the same generator.
        pixels = self.pipeline.image_processor.preprocess(image, height=height, width=width)
        vae = self.pipeline.vae
        latents = retrieve_latents(vae.encode(pixels.to(self.device, vae.dtype)), generator=generator)
        latents = self._scale_image_latents(latents.to(self.dtype))
        latents = torch.cat([latents] * n)
        noise = randn_tensor(latents.shape, generator=generator, device=self.device, dtype=self.dtype)
        a, b = start_noise
        return a * latents + b * noise

    def _scale_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline.vae.config.scaling_factor * latents

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        return self.pipeline.unet(
            latents,
            timesteps,
            encoder_hidden_states=conditions["prompt_embeds"],
            timestep_cond=self._timestep_cond(guidance, latents.dtype),
            return_dict=False,
        )[0]

    def _timestep_cond(self, guidance: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """LCM-distilled UNets take (guidance - 1) per row as an embedding; others take nothing."""
        dim = self.pipeline.unet.config.time_cond_proj_dim
        if dim is None:
            return None
        embedding = self.pipeline.get_guidance_scale_embedding(guidance.float().cpu() - 1, embedding_dim=dim)
        return embedding.to(device=self.device, dtype=dtype)

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        vae = self.pipeline.vae
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pt")
