"""SDXL: two CLIP text encoders, pooled embeddings, and the added time ids (size, crop) per request."""
from __future__ import annotations

import torch

from dvllm.models.base import Conditions
from dvllm.models.layout import BatchLayout
from dvllm.models.stable_diffusion import StableDiffusionAdapter


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    pipeline_classes = ("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline")
    load_kwargs = {"add_watermarker": False}  # dvllm returns the model's own pixels
    family = "stable-diffusion-xl"
    default_guidance = 5.0
    default_strength = 0.3  # StableDiffusionXLImg2ImgPipeline's
    default_inpaint_strength = 0.9999  # StableDiffusionXLInpaintPipeline's: it skips the first step

    def __init__(self, pipeline, name: str, device: torch.device, dtype: torch.dtype) -> None:
        if pipeline.config.get("requires_aesthetics_score", False):
            raise ValueError(f"{name}: SDXL models that take an aesthetic score (requires_aesthetics_score, the "
                             "refiner) are not supported")
        super().__init__(pipeline, name, device, dtype)
        vae = pipeline.vae
        # The pipeline decodes in float32 when a float16 VAE would overflow; keep that copy resident
        # instead of casting the VAE back and forth at every decode.
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(torch.float32)

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        # A missing negative prompt is all zeros when the model says so (force_zeros_for_empty_prompt);
        # any other text, negative or not, goes through both encoders exactly as a prompt does.
        zero = [neg and text is None and self.pipeline.config.force_zeros_for_empty_prompt for text, neg in texts]
        prompts = [text or "" for (text, _), z in zip(texts, zero) if not z]
        encoded: list[Conditions] = []
        if prompts:
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
            )
            encoded = [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds.split(1), pooled.split(1))]
        out, it = [], iter(encoded)
        for z in zero:
            out.append(self._zeros() if z else next(it))
        return out

    def _zeros(self) -> Conditions:
        # (info probes with a positive prompt, so this never runs before info exists)
        shapes = self.info.condition_shapes
        return {k: torch.zeros((1, *shape), dtype=self.dtype, device=self.device) for k, shape in shapes.items()}

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        pipe = self.pipeline
        return pipe.unet(
            self.unet_input(latents, conditions), timesteps, encoder_hidden_states=conditions["prompt_embeds"],
            timestep_cond=conditions.get("timestep_cond"),
            added_cond_kwargs={"text_embeds": conditions["pooled_prompt_embeds"], "time_ids": conditions["time_ids"]},
            return_dict=False,
        )[0]

    def step_conditions(self, layout: BatchLayout, dtype: torch.dtype) -> Conditions:
        """The added time ids, made on the host as the pipeline makes them: one forward, one size, so one
        (original size, crop, target size) for every row."""
        pipe = self.pipeline
        projection_dim = (pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None
                          else self.info.condition_shapes["pooled_prompt_embeds"][-1])
        time_ids = _add_time_ids(pipe, layout.image_size, projection_dim, dtype)
        return {**super().step_conditions(layout, dtype), "time_ids": time_ids.repeat(layout.num_rows, 1)}

    def _scale_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipeline.vae.config
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            return (latents - mean) * config.scaling_factor / std
        return config.scaling_factor * latents

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        vae = self.pipeline.vae
        config = vae.config
        latents = latents.to(vae.dtype)
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / config.scaling_factor + mean
        else:
            latents = latents / config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pt")


def _add_time_ids(pipe, size: tuple[int, int], projection_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(original size, crop (0, 0), target size), as the text-to-image and inpainting pipelines both make them
    (their _get_add_time_ids differ in signature, not in these ids without an aesthetic score)."""
    ids = [*size, 0, 0, *size]
    unet = pipe.unet
    passed = unet.config.addition_time_embed_dim * len(ids) + projection_dim
    expected = unet.add_embedding.linear_1.in_features
    if expected != passed:
        raise ValueError(f"the UNet expects {expected} added-condition features, the time ids make {passed}")
    return torch.tensor([ids], dtype=dtype)
