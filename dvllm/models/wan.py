"""Wan 2.1 / 2.2 text-to-video: a UMT5 text encoder, a 3D DiT over [C, frames, h, w] latents, a causal 3D VAE.

A video is a request like an image, with frames: its latents hold the first frame and one latent frame for
each `vae_scale_factor_temporal` frames after it, and rows of one size and frame count share a forward.
The pipeline runs cond and uncond in two calls; here they are rows of one call, as for every family (each
row's output depends on its own inputs only). The text is padded with zeros to max_sequence_length and
attended unmasked, as the pipeline does: every prompt has the one shape, so only the default length is served.

Wan 2.2 TI2V (expand_timesteps) takes the timestep per latent token; it is the row's one timestep in text-to-
video, and a request with an image is image-to-video (models/wan_ti2v.py), whichever Wan pipeline class holds
the checkpoint. Wan 2.2 A14B has two experts: `transformer` for timesteps at and above boundary_ratio * the
training steps, `transformer_2` below, each with its guidance scale (guidance_scale_2). Rows on either side of
the boundary in one step run one call per expert; both stay resident.
"""
from __future__ import annotations

import dataclasses
from functools import cached_property, partial
from typing import Any

import torch

from dvllm.models.base import CacheSpec, Conditions, HookContext, ModelAdapter, transformer_cache_spec
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Latents, ModelInfo, Schedule, Text, Video
from dvllm.models.wan_ti2v import first_frame_inputs, prepare_first_frame, timestep_mask
from dvllm.request_sizes import aspect_size

MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s max_sequence_length
WAN21_FPS, WAN22_FPS = 16.0, 24.0  # the rates the models' cards export their videos at (TI2V-5B: 24)


class WanAdapter(ModelAdapter):
    pipeline_classes = ("WanPipeline",)
    half_dtype = torch.bfloat16  # its pipelines' documented dtype

    def __init__(self, pipeline: Any, name: str, device: torch.device, dtype: torch.dtype) -> None:
        if pipeline.transformer is None:
            raise ValueError(f"{name}: a Wan pipeline without its first transformer is not served")
        two = pipeline.config.boundary_ratio is not None
        if two and getattr(pipeline, "transformer_2", None) is None:
            raise ValueError(f"{name}: boundary_ratio names a second expert, but the pipeline has no transformer_2")
        super().__init__(pipeline, name, device, dtype)
        # the pipeline runs transformer_2 only below a boundary: without one, the first expert runs every step
        self.experts = (pipeline.transformer, pipeline.transformer_2) if two else (pipeline.transformer,)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float32  # the pipeline draws and steps its latents in float32, whatever the transformer's

    @cached_property
    def info(self) -> ModelInfo:
        pipe = self.pipeline
        config = pipe.transformer.config
        spatial = pipe.vae_scale_factor_spatial
        expand = bool(pipe.config.expand_timesteps)
        # The rotary table has rope_max_seq_len positions along each of frames, height and width (in patches):
        # a video longer or larger than it fails in the forward (both experts must hold it)
        positions = min(expert.config.rope_max_seq_len for expert in self.experts)
        info = ModelInfo(
            family="wan", pipeline_class=type(pipe).__name__,
            # WanPipeline.__call__'s defaults
            defaults=Defaults(steps=50, guidance=5.0, height=480, width=832),
            schedule=Schedule(self.scheduler_config(), output_dtype_differs=self.dtype != self.state_dtype),
            latents=Latents(channels=pipe.vae.config.z_dim, scale=spatial, size_factor=spatial * config.patch_size[1],
                            temporal_scale=pipe.vae_scale_factor_temporal,
                            max_side=positions * spatial * min(config.patch_size[1:])),
            text=Text(self.probe_condition_shapes(), max_sequence_length=MAX_SEQUENCE_LENGTH),
            video=Video(frames=81, fps=WAN22_FPS if expand else WAN21_FPS,
                        frame_multiple=pipe.vae_scale_factor_temporal,
                        max_frames=(positions * config.patch_size[0] - 1) * pipe.vae_scale_factor_temporal + 1),
            expert_boundary=None if len(self.experts) == 1 else
            pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps,
            cache_layout=self.cache_layout(),
        )
        return dataclasses.replace(info, images=first_frame_inputs(info)) if expand else info

    def follow_defaults(self, info: ModelInfo) -> ModelInfo:
        # an image request that names no size gets the default area at its image's aspect ratio: the area of the
        # defaults in force (TI2V-5B's card: 704x1280), not the pipeline's
        if info.images.edit_size is None:
            return info
        area = info.defaults.height * info.defaults.width
        return dataclasses.replace(info, images=dataclasses.replace(
            info.images, edit_size=partial(aspect_size, area, info.latents.size_factor)))

    def probe_condition_shapes(self) -> dict[str, tuple[int, ...]]:
        # every prompt is padded to the one length with the encoder's width: known without running it (which
        # meta-device estimates cannot do)
        return {"prompt_embeds": (MAX_SEQUENCE_LENGTH, self.pipeline.text_encoder.config.d_model)}

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        embeds, _ = self.pipeline.encode_prompt(
            [text or "" for text, _ in texts], do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length or MAX_SEQUENCE_LENGTH, device=self.encoder_device)
        embeds = embeds.to(self.dtype)  # as the pipeline casts them to the transformer's dtype
        return [{"prompt_embeds": e} for e in embeds.split(1)]

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        return self.prepare_video_latents(n, height, width, 1, generator, init_noise_sigma)

    def prepare_video_latents(self, n: int, height: int, width: int, frames: int, generator: torch.Generator,
                              init_noise_sigma: float) -> torch.Tensor:
        from diffusers import WanPipeline

        channels = self.pipeline.vae.config.z_dim  # the transformer may take more: an image's condition (I2V)
        # WanPipeline's draw, also where WanImageToVideoPipeline holds the model (TI2V's text-to-video)
        latents = WanPipeline.prepare_latents(self.pipeline, n, channels, height, width, frames, torch.float32,
                                              self.device, generator)
        return latents * init_noise_sigma

    def prepare_image_to_video(self, image: Any, n: int, height: int, width: int, frames: int,
                               generator: torch.Generator, init_noise_sigma: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.pipeline.config.expand_timesteps:
            return super().prepare_image_to_video(image, n, height, width, frames, generator, init_noise_sigma)
        return prepare_first_frame(self.pipeline, image, n, height, width, frames, generator, init_noise_sigma,
                                   self.device)

    def step_conditions(self, layout: BatchLayout, dtype: torch.dtype) -> Conditions:
        if not self.pipeline.config.expand_timesteps:
            return {}
        return {"timestep_mask": timestep_mask(layout, self.info.latents, self.pipeline.transformer.config.patch_size)}

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        timestep, embeds = timesteps.to(torch.float32), conditions["prompt_embeds"]
        if self.pipeline.config.expand_timesteps:  # one timestep per latent token (TI2V): 0 on a given first frame
            timestep = conditions["timestep_mask"] * timestep[:, None]
        experts = layout.row_experts or (0,) * len(latents)
        hidden, extra = self.transformer_inputs(latents, conditions)

        def call(rows: list[int], index: Any) -> torch.Tensor:
            model = self.experts[experts[rows[0]]]
            # the pool keeps float32: the inputs in the transformer's dtype, as the pipeline casts them
            return model(hidden_states=hidden[index].to(model.dtype), timestep=timestep[index],
                         encoder_hidden_states=embeds[index].to(model.dtype), return_dict=False,
                         **{key: value[index].to(model.dtype) for key, value in extra.items()})[0]

        return self.call_per_group(list(experts), latents, call, context)

    def transformer_inputs(self, latents: torch.Tensor, conditions: Conditions
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The transformer's hidden states for these rows, and its other per-row inputs (image-to-video's)."""
        return latents, {}

    def cache_spec(self) -> CacheSpec | None:
        # The pipeline calls cond and uncond apart, each in its own cache_context: each branch decides alone.
        # A block's output is its hidden stream, the video's tokens; both its attentions (self and cross) give
        # video tokens, and TaylorSeer predicts both (diffusers' default patterns, "^blocks.*attn" matched whole,
        # match neither attn1 nor attn2: there it predicts nothing). Two experts are not cached (docs/video.md):
        # a row's kept state is one transformer's block outputs, and the hooks sit on one transformer's blocks.
        if len(self.experts) > 1:
            return None
        t, pipe = self.pipeline.transformer, self.pipeline
        return transformer_cache_spec(
            list(t.blocks), [(attn, ("image",)) for b in t.blocks for attn in (b.attn1, b.attn2)],
            inner_dim=t.config.num_attention_heads * t.config.attention_head_dim,
            pixels_per_token=pipe.vae_scale_factor_spatial * t.config.patch_size[1], dtype=self.state_dtype,
            text_tokens=MAX_SEQUENCE_LENGTH, temporal_scale=pipe.vae_scale_factor_temporal, hidden_index=None,
            separate_cfg_branches=True)

    def graph_key(self, layout: BatchLayout) -> Any:
        return layout.image_size, layout.row_experts  # one call per expert among the rows

    def decode(self, latents: torch.Tensor, image_size: tuple[int, ...]) -> torch.Tensor:
        pipe, config = self.pipeline, self.pipeline.vae.config
        latents = latents.to(pipe.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        video = pipe.vae.decode(latents / std + mean, return_dict=False)[0]  # [B, 3, frames, H, W] in [-1, 1]
        return pipe.video_processor.postprocess_video(video, output_type="pt")  # [B, frames, 3, H, W] in [0, 1]
