"""Stable Diffusion 1.x / 2.x: UNet2DConditionModel, CLIP text encoder, epsilon or v-prediction.

Inpainting runs as StableDiffusionInpaintPipeline does. A regular (4-channel) UNet denoises everything
and the known region is put back, re-noised, after every step; an inpainting UNet (9 channels) takes the
mask and the masked image's latents as extra input channels and needs no blending.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from dvllm.models.base import Conditions, HookContext, ModelAdapter
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text


class StableDiffusionAdapter(ModelAdapter):
    pipeline_classes = ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")
    load_kwargs = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    family = "stable-diffusion"
    default_guidance = 7.5  # the pipeline's __call__ defaults
    default_strength = 0.8  # StableDiffusionImg2ImgPipeline's
    default_inpaint_strength = 1.0  # StableDiffusionInpaintPipeline's
    controlnet_class = "ControlNetModel"  # SD's and SDXL's (StableDiffusion[XL]ControlNetPipeline)
    ip_adapter_kind = "unet"

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        default_size = pipe.unet.config.sample_size * factor
        return ModelInfo(
            family=self.family, pipeline_class=type(pipe).__name__,
            defaults=Defaults(steps=50, guidance=self.default_guidance, height=default_size, width=default_size,
                              strength=self.default_strength, inpaint_strength=self.default_inpaint_strength),
            # prepare_extra_step_kwargs passes eta and generator; __call__'s eta is 0.0
            schedule=Schedule(self.scheduler_config(), step_kwargs=("eta", "generator"), eta=0.0),
            # the pipeline's check_inputs wants multiples of 8
            latents=Latents(channels=pipe.vae.config.latent_channels, scale=factor, size_factor=max(8, factor)),
            text=Text(self.probe_condition_shapes()),
            # LCM-distilled UNets embed the guidance scale instead of running CFG rows.
            guidance=Guidance(supported=pipe.unet.config.time_cond_proj_dim is None),
            images=ImageInputs(img2img=True, inpaint_channels=self._inpaint_channels,
                               requires_mask=self.inpainting_unet, denoiser_takes_inputs=self.inpainting_unet,
                               controls=True),
        )

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        # An absent negative prompt is the empty string, as in the pipeline. Every text is
        # padded to the tokenizer's max length, so one batched pass equals separate ones.
        prompts = [text or "" for text, _ in texts]
        embeds, _ = self.pipeline.encode_prompt(
            prompts, self.encoder_device, num_images_per_prompt=1, do_classifier_free_guidance=False
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

    @property
    def inpainting_unet(self) -> bool:
        """An inpainting UNet: latents, then the mask and the masked image's latents, as input channels."""
        unet, vae = self.pipeline.unet.config, self.pipeline.vae.config
        if unet.in_channels == vae.latent_channels:
            return False
        if unet.in_channels != 2 * vae.latent_channels + 1:
            raise ValueError(f"{self.name}: a UNet of {unet.in_channels} input channels is neither a regular one "
                             f"({vae.latent_channels}) nor an inpainting one ({2 * vae.latent_channels + 1})")
        return True

    @property
    def _inpaint_channels(self) -> int:
        # per image: the mask, then the masked image's latents (inpainting UNet) or the image's latents and
        # the first noise, which re-noise the known region after each step (regular UNet)
        return 1 + (1 if self.inpainting_unet else 2) * self.pipeline.vae.config.latent_channels

    def prepare_inpaint(self, image: Any, mask: Any, n: int, height: int, width: int, generator: torch.Generator,
                        plan: Any, strength: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(start latents, per-image inpainting state [n, inpaint_channels, h, w]), with every random draw where
        the inpainting pipeline makes it: the image's VAE sample (when it is needed), the noise, then the
        masked image's VAE sample (drawn even where a regular UNet never reads it)."""
        pipe, scale = self.pipeline, self.info.latents.scale
        pixels = pipe.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
        mask_pixels = self._mask_processor.preprocess(mask, height=height, width=width)
        full_noise = strength == 1.0  # the pipelines start from pure noise only at exactly 1.0
        image_latents = None
        if not self.inpainting_unet or not full_noise:
            image_latents = self._vae_sample(pixels, generator).repeat(n, 1, 1, 1)
        noise = randn_tensor((n, *self.latent_shape(height, width)), generator=generator, device=self.device,
                             dtype=self.dtype)
        if full_noise:
            latents = noise * plan.init_noise_sigma
        else:
            a, b = plan.start_noise
            latents = a * image_latents + b * noise
        # the mask reaches the latent grid by nearest-neighbour resizing (interpolate's default)
        mask = torch.nn.functional.interpolate(mask_pixels, size=(height // scale, width // scale))
        mask = mask.to(self.device, self.dtype).repeat(n, 1, 1, 1)
        masked_latents = self._vae_sample(pixels * (mask_pixels < 0.5), generator).repeat(n, 1, 1, 1)
        state = [mask, masked_latents] if self.inpainting_unet else [mask, image_latents, noise]
        return latents, torch.cat(state, dim=1)

    @cached_property
    def _mask_processor(self) -> VaeImageProcessor:
        # the inpainting pipelines' own: grey, binarized at 0.5, not normalized (a plain pipeline has none)
        return getattr(self.pipeline, "mask_processor", None) or VaeImageProcessor(
            vae_scale_factor=self.pipeline.vae_scale_factor, do_normalize=False, do_binarize=True,
            do_convert_grayscale=True)

    def _vae_sample(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """As the inpainting pipelines' _encode_vae_image: a VAE sample drawn from the generator, scaled."""
        vae = self.pipeline.vae
        latents = retrieve_latents(vae.encode(pixels.to(self.device, vae.dtype)), generator=generator)
        return vae.config.scaling_factor * latents.to(self.dtype)

    def _scale_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline.vae.config.scaling_factor * latents

    def unet_input(self, latents: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """The UNet's input: an inpainting UNet's takes each row's mask and masked-image latents after its latents."""
        if not self.inpainting_unet:
            return latents
        inputs = conditions["image_inputs"][:, :self.info.images.inpaint_channels * latents[0, 0].numel()]
        return torch.cat([latents, inputs.view(len(latents), -1, *latents.shape[2:]).to(latents.dtype)], dim=1)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        return self.pipeline.unet(
            self.unet_input(latents, conditions),
            timesteps,
            encoder_hidden_states=conditions["prompt_embeds"],
            timestep_cond=conditions.get("timestep_cond"),
            return_dict=False,
        )[0]

    def step_conditions(self, layout: BatchLayout, dtype: torch.dtype) -> Conditions:
        """LCM-distilled UNets take (guidance - 1) per row as an embedding, which the pipeline computes on the
        host; others take nothing."""
        dim = self.pipeline.unet.config.time_cond_proj_dim
        if dim is None:
            return {}
        w = torch.tensor([g - 1 for g in layout.per_row(layout.guidance)], dtype=torch.float32)
        return {"timestep_cond": self.pipeline.get_guidance_scale_embedding(w, embedding_dim=dim).to(dtype)}

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        vae = self.pipeline.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pt")
