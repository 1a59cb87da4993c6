"""Z-Image: a Qwen3 text encoder, a single-stream DiT over lists of variable-length captions.

As Qwen-Image, each prompt's embedding is stored padded to MAX_TEXT_TOKENS with its mask
(a fixed-size prompt-cache entry); the transformer takes a list with each caption cut
back to its own length. Z-Image's guidance is pos + g * (pos - neg), on whenever g > 0,
and its transformer predicts the negated velocity on reversed time, which denoise()
turns into what the flow scheduler steps on.
ControlNet: ZImageControlNetModels, as ZImageControlNetPipeline runs them (worker/z_image_controlnet.py).
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from diffusers.pipelines.z_image.pipeline_z_image_controlnet import retrieve_latents

from dvllm.models.base import CacheSpec, Conditions, HookContext, ModelAdapter, transformer_cache_spec
from dvllm.models.flow_common import dynamic_shift_mu, image_seq_len
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import Defaults, Guidance, ImageInputs, Latents, ModelInfo, Schedule, Text

MAX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length
SEQ_MULTIPLE = 32  # the transformer pads image and caption tokens to multiples of this (SEQ_MULTI_OF)


def z_image_timestep_kwargs(vae_scale: int, height: int, width: int, num_steps: int,
                            config: dict[str, Any]) -> dict[str, Any]:
    """As ZImagePipeline: sigmas from 1 to 1/steps (torch's float32 linspace) and a size-dependent mu."""
    return {"sigmas": torch.linspace(1.0, 1 / num_steps, num_steps).tolist(),
            "mu": dynamic_shift_mu(config, image_seq_len(height, width, vae_scale, 2))}


class ZImageAdapter(ModelAdapter):
    pipeline_classes = ("ZImagePipeline",)
    load_kwargs: dict[str, Any] = {}
    half_dtype = torch.bfloat16  # its pipelines' documented dtype
    controlnet_class = "ZImageControlNetModel"  # ZImageControlNetPipeline's (the Fun controlnets)

    def __init__(self, pipeline: Any, name: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(pipeline, name, device, dtype)
        # The transformer builds its RoPE tables on the host on its first call and copies them over: made here,
        # the forward needs no copy (a CUDA graph could not capture one) and traces whole under torch.compile.
        rope = getattr(pipeline.transformer, "rope_embedder", None)
        if rope is not None and getattr(rope, "freqs_cis", None) is None:
            tables = rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens, theta=rope.theta)
            rope.freqs_cis = [t.to(device) for t in tables]

    @cached_property
    def info(self) -> ModelInfo:
        from functools import partial

        pipe = self.pipeline
        factor = pipe.vae_scale_factor
        hidden = pipe.text_encoder.config.hidden_size
        return ModelInfo(
            family="z-image", pipeline_class=type(pipe).__name__,
            defaults=Defaults(steps=50, guidance=5.0, height=1024, width=1024),  # the pipeline's defaults
            schedule=Schedule(self.scheduler_config(), timestep_kwargs=partial(z_image_timestep_kwargs, factor)),
            latents=Latents(channels=pipe.transformer.in_channels, scale=factor, size_factor=factor * 2,
                            max_side=self._max_side(factor * 2)),
            text=Text({"prompt_embeds": (MAX_TEXT_TOKENS, hidden), "prompt_embeds_mask": (MAX_TEXT_TOKENS,)},
                      max_sequence_length=MAX_TEXT_TOKENS, sequence_length_range=(1, MAX_TEXT_TOKENS)),
            guidance=Guidance(threshold=0.0),
            # ZImageControlNetPipeline sizes a request as ZImagePipeline (1024x1024 unless given); its control
            # input is made at the request's start (the VAE's mode: no draw), held with the request
            images=ImageInputs(control_sets_size=False, control_input_is_image=False),
            cache_layout=self.cache_layout(),
        )

    def _max_side(self, pixels_per_token: int) -> int | None:
        """The longest side the RoPE tables cover: their height and width lengths, in tokens of 2x2 latents."""
        rope = getattr(self.pipeline.transformer, "rope_embedder", None)
        lengths = getattr(rope, "axes_lens", None)
        return None if lengths is None else min(lengths[1:]) * pixels_per_token

    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        embeds, _ = self.pipeline.encode_prompt([text or "" for text, _ in texts], device=self.encoder_device,
                                                do_classifier_free_guidance=False,
                                                max_sequence_length=max_sequence_length or MAX_TEXT_TOKENS)
        out = []
        for e in embeds:  # [length, hidden] each
            padded = e.new_zeros(1, MAX_TEXT_TOKENS, e.shape[-1])
            padded[0, :len(e)] = e
            mask = e.new_zeros(1, MAX_TEXT_TOKENS)
            mask[0, :len(e)] = 1
            out.append({"prompt_embeds": padded, "prompt_embeds_mask": mask})
        return out

    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        # The pipeline keeps its latents in float32 whatever the model's dtype.
        latents = self.pipeline.prepare_latents(n, self.pipeline.transformer.in_channels, height, width,
                                                torch.float32, self.device, generator)
        return (latents * init_noise_sigma).to(self.dtype)

    def control_input(self, image: torch.Tensor, controlnet: Any, n: int, generator: torch.Generator,
                      first: Any) -> torch.Tensor:
        """As ZImageControlNetPipeline: the image normalized to [-1, 1], VAE-encoded to its distribution's mode (no
        draw from `generator`), shifted and scaled, as one frame whose channels are zero-padded to the controlnet's
        control_in_dim: [1, control_in_dim, 1, h, w], the same for each of the request's images and CFG rows."""
        vae = self.pipeline.vae
        latents = retrieve_latents(vae.encode((2.0 * image - 1.0).to(self.device, vae.dtype)), sample_mode="argmax")
        latents = ((latents - vae.config.shift_factor) * vae.config.scaling_factor).unsqueeze(2)
        missing = controlnet.config.control_in_dim - latents.shape[1]
        if missing:
            latents = torch.cat([latents, latents.new_zeros(1, missing, *latents.shape[2:])], dim=1)
        return latents.to(controlnet.dtype)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None
                ) -> torch.Tensor:
        transformer = self.pipeline.transformer
        captions = [e[:n] for e, n in zip(conditions["prompt_embeds"], layout.row_text_lengths)]
        frames = list(latents.to(transformer.dtype).unsqueeze(2).unbind(dim=0))
        out = transformer(frames, (1000 - timesteps) / 1000, captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def cache_spec(self) -> CacheSpec:
        # diffusers has no enable_cache for Z-Image: dvllm applies the same rules to its main layers (the
        # refiners always run) and the attention of each. Their single stream is image then caption, each
        # padded to 32 tokens, then padded to the batch's longest: state keeps a row's own part, and
        # first_block measures over its real tokens. The pipeline batches a request's CFG rows in one call.
        t = self.pipeline.transformer
        return transformer_cache_spec(
            list(t.layers), [(layer.attention, ("unified",)) for layer in t.layers], inner_dim=t.dim,
            pixels_per_token=self.pipeline.vae_scale_factor * 2, dtype=self.dtype, text_tokens=None,
            hidden_kind="unified", token_multiple=SEQ_MULTIPLE, hidden_index=None, hidden_arg="x", mask_arg="attn_mask")

    def graph_key(self, layout: BatchLayout) -> Any:
        return layout.image_size, layout.row_text_lengths  # each caption goes in at its own length

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return cond + scale * (cond - uncond)  # Z-Image's form: g = 0 is no guidance

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pt")
