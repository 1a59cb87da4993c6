"""Qwen-Image: a Qwen2.5-VL text encoder, MMDiT over packed latents, "true" CFG with its own rescaling.

Text embeddings have a different length for every prompt. The pool stores each one
padded to the pipeline's maximum (MAX_TEXT_TOKENS) with its mask; a batch is cut back
to its longest prompt, and the mask keeps the padding out of attention. Padding instead
of packing keeps every prompt a fixed-size entry in the prompt cache, and the text
positions of real tokens (Qwen's RoPE) do not change with padding.

dvllm's guidance_scale is the pipeline's `true_cfg_scale`: as in diffusers, CFG runs only
for requests with a negative prompt. Guidance-distilled variants (guidance_embeds) are not served.
ControlNet: QwenImageControlNetModels, as QwenImageControlNetPipeline runs them (worker/qwen_controlnet.py).
"""
from __future__ import annotations

from functools import cached_property, partial
from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_controlnet import retrieve_latents

from dvllm.models.base import CacheSpec, Conditions, HookContext, ModelAdapter, transformer_cache_spec
from dvllm.models.flux import flux_timestep_kwargs
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text

MAX_TEXT_TOKENS = 1024  # the pipeline's tokenizer_max_length and the most max_sequence_length it accepts
DEFAULT_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s max_sequence_length


class QwenImageAdapter(ModelAdapter):
    pipeline_classes = ("QwenImagePipeline",)
    load_kwargs: dict[str, Any] = {}
    half_dtype = torch.bfloat16  # its pipelines' documented dtype
    controlnet_class = "QwenImageControlNetModel"  # QwenImageControlNetPipeline's (InstantX's)

    def __init__(self, pipeline: Any, name: str, device: torch.device, dtype: torch.dtype) -> None:
        if pipeline.transformer.config.guidance_embeds:
            raise ValueError(f"{name}: guidance-distilled Qwen-Image models (guidance_embeds) are not supported")
        super().__init__(pipeline, name, device, dtype)

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        hidden = pipe.text_encoder.config.text_config.hidden_size
        side = pipe.default_sample_size * factor
        return ModelInfo(
            family="qwen-image", pipeline_class=type(pipe).__name__,
            # the pipeline's num_inference_steps and true_cfg_scale
            defaults=Defaults(steps=50, guidance=4.0, height=side, width=side),
            schedule=Schedule(self.scheduler_config(), timestep_kwargs=partial(flux_timestep_kwargs, factor)),
            latents=Latents(channels=pipe.transformer.config.in_channels // 4, scale=factor, size_factor=factor * 2,
                            patch=2),
            text=Text({"prompt_embeds": (MAX_TEXT_TOKENS, hidden), "prompt_embeds_mask": (MAX_TEXT_TOKENS,)},
                      max_sequence_length=DEFAULT_SEQUENCE_LENGTH, sequence_length_range=(1, MAX_TEXT_TOKENS)),
            guidance=Guidance(needs_negative_prompt=True),  # "true CFG"
            # QwenImageControlNetPipeline sizes a request as QwenImagePipeline, encodes its control images with its
            # generator, and takes several images of one controlnet only (QwenImageMultiControlNetModel)
            images=ImageInputs(control_sets_size=False, control_input_is_image=False, controls_one_controlnet=True),
            cache_layout=self.cache_layout(),
        )

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        length = max_sequence_length or DEFAULT_SEQUENCE_LENGTH
        embeds, mask = self.pipeline.encode_prompt([text or "" for text, _ in texts], device=self.encoder_device,
                                                   num_images_per_prompt=1, max_sequence_length=length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = MAX_TEXT_TOKENS - embeds.shape[1]
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad)).to(embeds.dtype)
        return [{"prompt_embeds": e, "prompt_embeds_mask": m} for e, m in zip(embeds.split(1), mask.split(1))]

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        channels = self.pipeline.transformer.config.in_channels // 4
        latents = self.pipeline.prepare_latents(n, channels, height, width, self.dtype, self.device, generator)
        return latents * init_noise_sigma

    def control_input(self, image: torch.Tensor, controlnet: Any, n: int, generator: torch.Generator,
                      first: Any) -> torch.Tensor:
        """As QwenImageControlNetPipeline: the image normalized to [-1, 1], repeated for the n images, VAE-encoded
        as one frame (a sample drawn from `generator`), normalized by the VAE's latent mean and std, packed:
        [n, tokens, 4 * channels]."""
        pipe, vae = self.pipeline, self.pipeline.vae
        pixels = (2.0 * image - 1.0).repeat_interleave(n, dim=0).to(self.device, vae.dtype).unsqueeze(2)
        latents = retrieve_latents(vae.encode(pixels), generator=generator)
        config = vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device)
        latents = ((latents - mean) * inverse_std).permute(0, 2, 1, 3, 4)  # [n, frames (1), channels, h, w]
        packed = pipe._pack_latents(latents, n, latents.shape[2], latents.shape[3], latents.shape[4])
        return packed.to(controlnet.dtype)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        pipe = self.pipeline
        lengths = layout.row_text_lengths
        length = max(lengths)  # the batch's longest prompt: the rest is padding
        mask, embeds = conditions["prompt_embeds_mask"][:, :length] > 0.5, conditions["prompt_embeds"][:, :length]
        size = layout.image_size
        patches = (1, size[0] // pipe.vae_scale_factor // 2, size[1] // pipe.vae_scale_factor // 2)
        return pipe.transformer(
            hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000, guidance=None,
            encoder_hidden_states_mask=None if min(lengths) == length else mask.long(), encoder_hidden_states=embeds,
            img_shapes=[[patches]] * len(latents), return_dict=False,
        )[0]

    def graph_key(self, layout: BatchLayout) -> Any:
        lengths = layout.row_text_lengths  # the texts are cut to the longest, masked unless all are as long
        return layout.image_size, max(lengths), min(lengths) == max(lengths)

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # As QwenImagePipeline: CFG, then each token rescaled to the conditional prediction's norm.
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def cache_spec(self) -> CacheSpec:
        # The pipeline calls cond and uncond apart, each in its own cache_context: each branch decides alone.
        # Taylor factors of the text stream are kept for as many tokens as the request's texts can have: a
        # byte-level BPE makes at most one token per byte of the templated text, of which the pipeline drops
        # its first prompt_template_encode_start_idx tokens (the worker checks each row's real length).
        pipe = self.pipeline
        template_bytes = len(pipe.prompt_template_encode.format("").encode("utf-8"))
        t = self.pipeline.transformer
        return transformer_cache_spec(
            list(t.transformer_blocks), [(b.attn, ("image", "text")) for b in t.transformer_blocks],
            inner_dim=t.config.num_attention_heads * t.config.attention_head_dim,
            pixels_per_token=self.pipeline.vae_scale_factor * 2, dtype=self.dtype, text_tokens=None,
            separate_cfg_branches=True, text_bytes_extra=template_bytes - pipe.prompt_template_encode_start_idx)

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        pipe, config = self.pipeline, self.pipeline.vae.config
        latents = pipe._unpack_latents(latents, image_size[0], image_size[1], pipe.vae_scale_factor).to(pipe.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        image = pipe.vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt")
