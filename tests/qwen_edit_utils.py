"""Tiny random-weight Qwen-Image-Edit pipelines (QwenImageEditPipeline, QwenImageEditPlusPipeline).

The components are tiny_qwen_image_pipeline's (conftest.py) except the VAE. The edit pipelines resize every input
image to about 1024x1024 px for the VAE whatever the output size, so what a call costs is set by the VAE's scale:
- vae_scale=16 (the default): one more level than the real VAE. Each input image is 32x32 = 1024 tokens for the
  transformer and the VAE's middle attention; a Plus call with two images, CFG and 3 steps takes 1.1 s on one core.
  Output sizes are multiples of 32.
- vae_scale=8, as the real VAE: 4096 tokens an image (a quadratic attention over 16384 latent pixels in the VAE's
  middle block), 4.3 s for the same call. tests/test_qwen_edit.py keeps one check of the pipeline's images at it.
The VAE has 8 channels at every level and no residual blocks. The processor is made from no files
(byte_qwen_vl_processor) with the vision token ids of the text encoder's config.
"""
from __future__ import annotations

import torch
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                       QwenImageEditPlusPipeline, QwenImageTransformer2DModel)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from dvllm.models.byte_tokenizer import byte_qwen_vl_processor

# ids in the text encoder's vocabulary of 300: 256 bytes, 3 chat tokens, then these
VISION_TOKEN_IDS = dict(vision_start_token_id=290, image_token_id=291, video_token_id=292)
VISION_END_TOKEN_ID = 293


def tiny_qwen_image_edit_pipeline(plus: bool = False, num_layers: int = 2,
                                  vae_scale: int = 16) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """A QwenImageEditPipeline (plus: a QwenImageEditPlusPipeline, which takes one or several images)."""
    if vae_scale not in (8, 16):
        raise ValueError(f"vae_scale must be 8 or 16, not {vae_scale}")
    halvings = 3 if vae_scale == 8 else 4  # Wan's VAE halves the time too at all but the first
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1] * (halvings + 1), num_res_blocks=0,
                                 temperal_downsample=[False] + [True] * (halvings - 1), latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4)
    torch.manual_seed(2)
    text_encoder = _tiny_text_encoder()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64,
                                                base_shift=0.5, max_shift=1.15, shift_terminal=0.02, shift=1.0,
                                                time_shift_type="exponential")
    processor = byte_qwen_vl_processor(vision_end_token_id=VISION_END_TOKEN_ID, **VISION_TOKEN_IDS)
    pipeline_cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = pipeline_cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor.tokenizer,
                        processor=processor, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_text_encoder() -> Qwen2_5_VLForConditionalGeneration:
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, rope_theta=1000000.0, vocab_size=300, max_position_embeddings=2048,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         bos_token_id=256, eos_token_id=258, pad_token_id=256),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        vocab_size=300, **VISION_TOKEN_IDS))
