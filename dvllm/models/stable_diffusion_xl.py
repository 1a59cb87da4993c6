"""SDXL: two CLIP text encoders, pooled embeddings, and the added time ids (size, crop) per request."""
from __future__ import annotations

import dataclasses
from functools import cached_property

import torch

from dvllm.models.base import Conditions, HookContext
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import ModelInfo
from dvllm.models.stable_diffusion import StableDiffusionAdapter
from dvllm.param_defaults import AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    # (the img2img class is what the refiner's folder names: served for image requests like any SDXL)
    pipeline_classes = ("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline",
                        "StableDiffusionXLImg2ImgPipeline")
    load_kwargs = {"add_watermarker": False}  # dvllm returns the model's own pixels
    family = "stable-diffusion-xl"
    default_guidance = 5.0
    default_strength = 0.3  # StableDiffusionXLImg2ImgPipeline's
    default_inpaint_strength = 0.9999  # StableDiffusionXLInpaintPipeline's: it skips the first step
    union_controlnet_class = "ControlNetUnionModel"  # StableDiffusionXLControlNetUnionPipeline's

    def __init__(self, pipeline, name: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(pipeline, name, device, dtype)
        vae = pipeline.vae
        # The pipeline decodes in float32 when a float16 VAE would overflow; keep that copy resident
        # instead of casting the VAE back and forth at every decode.
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(torch.float32)

    @cached_property
    def info(self) -> ModelInfo:
        # A UNet trained with an aesthetic score takes it in its time ids instead of the target size
        info = super().info
        scores = bool(self.pipeline.config.get("requires_aesthetics_score"))
        return dataclasses.replace(info, images=dataclasses.replace(info.images, aesthetic_scores=scores))

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        # A missing negative prompt is all zeros when the model says so (force_zeros_for_empty_prompt);
        # any other text, negative or not, goes through both encoders exactly as a prompt does.
        zero = [neg and text is None and self.pipeline.config.force_zeros_for_empty_prompt for text, neg in texts]
        prompts = [text or "" for (text, _), z in zip(texts, zero) if not z]
        encoded: list[Conditions] = []
        if prompts:
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompts, device=self.encoder_device, num_images_per_prompt=1, do_classifier_free_guidance=False
            )
            encoded = [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds.split(1), pooled.split(1))]
        out, it = [], iter(encoded)
        for z in zero:
            out.append(self._zeros() if z else next(it))
        return out

    def _zeros(self) -> Conditions:
        # (info probes with a positive prompt, so this never runs before info exists)
        shapes = self.info.text.condition_shapes
        return {k: torch.zeros((1, *shape), dtype=self.dtype, device=self.device) for k, shape in shapes.items()}

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        pipe = self.pipeline
        return pipe.unet(
            self.unet_input(latents, conditions), timesteps, encoder_hidden_states=conditions["prompt_embeds"],
            timestep_cond=conditions.get("timestep_cond"),
            added_cond_kwargs={"text_embeds": conditions["pooled_prompt_embeds"], "time_ids": conditions["time_ids"]},
            return_dict=False,
        )[0]

    def step_conditions(self, layout: BatchLayout, dtype: torch.dtype) -> Conditions:
        """The added time ids, made on the host as the pipeline makes them: one forward, one size, so one
        (original size, crop, target size) for every row; for a model trained with an aesthetic score,
        (original size, crop, score) with each request's score on its prompt rows and its negative score on
        its negative rows."""
        pipe = self.pipeline
        projection_dim = (pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None
                          else self.info.text.condition_shapes["pooled_prompt_embeds"][-1])
        size = list(layout.image_size)
        if self.info.images.aesthetic_scores:  # (a layout that names no scores, the memory profile's: the defaults)
            scores = layout.aesthetic_scores or ((AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE),) * len(layout.counts)
            rows = [[*size, 0, 0, scores[r][negative]] for r, negative in zip(layout.row_request, layout.row_negative)]
        else:
            rows = [[*size, 0, 0, *size]] * layout.num_rows
        return {**super().step_conditions(layout, dtype), "time_ids": _time_ids(pipe, rows, projection_dim, dtype)}

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


def _time_ids(pipe, rows: list[list[float]], projection_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row's added time ids, as the pipelines' _get_add_time_ids make them, checked against the UNet."""
    unet = pipe.unet
    passed = unet.config.addition_time_embed_dim * len(rows[0]) + projection_dim
    expected = unet.add_embedding.linear_1.in_features
    if expected != passed:
        raise ValueError(f"the UNet expects {expected} added-condition features, the time ids make {passed} (an "
                         "aesthetic-score UNet needs requires_aesthetics_score in its model_index.json, and one "
                         "without it must not have it)")
    return torch.tensor(rows, dtype=dtype)
