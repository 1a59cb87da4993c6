"""Tiny random-weight Stable Diffusion pipelines, saved with save_pretrained and loaded back
through the engine's real loader. No network: the tokenizer is made from local files."""
from __future__ import annotations

import os

# One intra-op thread in every process of the suite: the pytest workers share the machine's cores (pytest -n),
# and each child process they start (core, stage and group processes, servers, CLI calls) inherits this instead
# of taking every core for itself. Results do not depend on it: references and engines run alike.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from dvllm.models.byte_tokenizer import byte_clip_tokenizer


def tiny_sd_pipeline(prediction_type: str = "epsilon", time_cond_proj_dim: int | None = None) -> StableDiffusionPipeline:
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=24, attention_head_dim=4, norm_num_groups=8, time_cond_proj_dim=time_cond_proj_dim,
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=24, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=600,
        max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513, projection_dim=24,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, prediction_type=prediction_type)
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=byte_clip_tokenizer(),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _saved(tmp_path_factory, name: str, pipe) -> str:
    """Saves a tiny pipeline where the engine's real loader will read it back."""
    path = tmp_path_factory.mktemp(name)
    pipe.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def sd_eps_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-sd-eps", tiny_sd_pipeline("epsilon"))


@pytest.fixture(scope="session")
def sd_v_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-sd-v", tiny_sd_pipeline("v_prediction"))


@pytest.fixture(scope="session")
def sd_guidance_embed_path(tmp_path_factory) -> str:
    """An LCM-distilled-style UNet: the guidance scale is embedded, no CFG rows."""
    return _saved(tmp_path_factory, "tiny-sd-lcm", tiny_sd_pipeline("epsilon", time_cond_proj_dim=8))


def tiny_sdxl_pipeline(force_zeros: bool = True):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 24, cross_attention_dim=48, norm_num_groups=8,
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )
    text_config = dict(hidden_size=24, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                       vocab_size=600, max_position_embeddings=77, bos_token_id=512, eos_token_id=513,
                       pad_token_id=513, projection_dim=24, hidden_act="gelu")
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**text_config))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_config))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=byte_clip_tokenizer(),
        tokenizer_2=byte_clip_tokenizer(pad_token="!"), unet=unet, scheduler=scheduler,
        force_zeros_for_empty_prompt=force_zeros, add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def sdxl_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-sdxl", tiny_sdxl_pipeline())


def tiny_sd3_pipeline(shift: float = 3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from dvllm.models.byte_tokenizer import byte_t5_tokenizer

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=48, pooled_projection_dim=48, out_channels=4,
    )
    clip = dict(hidden_size=24, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=600,
                max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513,
                projection_dim=24, hidden_act="gelu")
    torch.manual_seed(1)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip))
    torch.manual_seed(2)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip))
    torch.manual_seed(3)
    text_encoder_3 = T5EncoderModel(T5Config(d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                             vocab_size=300, decoder_start_token_id=0))
    torch.manual_seed(4)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), vae=vae,
        text_encoder=text_encoder, tokenizer=byte_clip_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=byte_clip_tokenizer(pad_token="!"), text_encoder_3=text_encoder_3,
        tokenizer_3=byte_t5_tokenizer(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def sd3_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-sd3", tiny_sd3_pipeline())


def tiny_flux_pipeline(num_layers: int = 1, num_single_layers: int = 1):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from dvllm.models.byte_tokenizer import byte_t5_tokenizer

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
        axes_dims_rope=[4, 4, 8], guidance_embeds=True,
    )
    torch.manual_seed(1)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=24, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=600,
        max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513, projection_dim=24,
        hidden_act="gelu"))
    torch.manual_seed(2)
    text_encoder_2 = T5EncoderModel(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                             vocab_size=300, decoder_start_token_id=0))
    torch.manual_seed(3)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=4, max_image_seq_len=64, shift=3.0)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=byte_clip_tokenizer(),
                        text_encoder_2=text_encoder_2, tokenizer_2=byte_t5_tokenizer(512), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def flux_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-flux", tiny_flux_pipeline())


def tiny_qwen_image_pipeline(num_layers: int = 2):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from dvllm.models.byte_tokenizer import byte_qwen_tokenizer

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, rope_theta=1000000.0, vocab_size=300, max_position_embeddings=2048,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         bos_token_id=256, eos_token_id=258, pad_token_id=256),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        vocab_size=300, vision_start_token_id=290, image_token_id=291, video_token_id=292))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64,
                                                base_shift=0.5, max_shift=1.15, shift_terminal=0.02, shift=1.0,
                                                time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=byte_qwen_tokenizer(), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def qwen_image_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-qwen-image", tiny_qwen_image_pipeline())


@pytest.fixture(scope="session")
def qwen_image_edit_path(tmp_path_factory) -> str:
    from qwen_edit_utils import tiny_qwen_image_edit_pipeline

    return _saved(tmp_path_factory, "tiny-qwen-image-edit", tiny_qwen_image_edit_pipeline())


@pytest.fixture(scope="session")
def qwen_image_edit_plus_path(tmp_path_factory) -> str:
    from qwen_edit_utils import tiny_qwen_image_edit_pipeline

    return _saved(tmp_path_factory, "tiny-qwen-image-edit-plus", tiny_qwen_image_edit_pipeline(plus=True))


def tiny_z_image_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from dvllm.models.byte_tokenizer import byte_qwen_tokenizer

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[1536, 32, 32],
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611,
    )
    torch.manual_seed(2)
    text_encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=300,
                                          max_position_embeddings=1024))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64,
                                                base_shift=0.5, max_shift=1.15, shift=3.0)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=byte_qwen_tokenizer(),
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def z_image_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-z-image", tiny_z_image_pipeline())


def _wan_parts(two_experts: bool, in_channels: int = 16, image_dim: int | None = None, wan22_vae: bool = False
               ) -> dict:
    """The components every tiny Wan pipeline shares, at diffusers' test sizes, with the real checkpoints'
    scheduler (UniPC over flow sigmas); two experts (A14B) where asked; with wan22_vae, the Wan 2.2 VAE's shape
    (TI2V-5B's: 48 channels, 2x2 pixel patches, 16x spatial compression) with uneven latents_mean and _std."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from dvllm.models.byte_tokenizer import byte_t5_tokenizer

    torch.manual_seed(0)
    if wan22_vae:
        vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                               latents_mean=[0.1 * (i % 7) - 0.3 for i in range(48)],
                               latents_std=[0.8 + 0.1 * (i % 5) for i in range(48)], dim_mult=[1, 1, 1, 1],
                               num_res_blocks=1, scale_factor_spatial=16, temperal_downsample=[False, True, True])
    else:
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    experts = []
    for seed in (1, 3) if two_experts else (1,):
        torch.manual_seed(seed)
        experts.append(WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
            out_channels=vae.config.z_dim, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            # a rotary table that covers the pipeline's default 480x832 (52 patches a side; diffusers' tests use 32)
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64, image_dim=image_dim))
    torch.manual_seed(2)
    text_encoder = UMT5EncoderModel(UMT5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                               vocab_size=300, decoder_start_token_id=0))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return dict(tokenizer=byte_t5_tokenizer(512), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                transformer=experts[0], transformer_2=experts[1] if two_experts else None)


def tiny_wan_pipeline(expand_timesteps: bool = False, two_experts: bool = False):
    """Wan 2.1 text-to-video (Wan 2.2 TI2V's timesteps with expand_timesteps, A14B's two experts with
    two_experts)."""
    from diffusers import WanPipeline

    pipe = WanPipeline(**_wan_parts(two_experts), boundary_ratio=0.875 if two_experts else None,
                       expand_timesteps=expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def wan_path(tmp_path_factory) -> str:
    return _saved(tmp_path_factory, "tiny-wan", tiny_wan_pipeline())


def tiny_wan_i2v_pipeline(two_experts: bool = False, image_encoder: bool = True):
    """Wan 2.1 image-to-video (36 input channels: the latents, a 4-channel frame mask and the image's encoded
    frames) with a tiny CLIP vision encoder; Wan 2.2 I2V A14B's shape with two_experts and no image encoder."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = _wan_parts(two_experts, in_channels=36, image_dim=4 if image_encoder else None)
    encoder = processor = None
    if image_encoder:
        torch.manual_seed(4)
        encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=32, intermediate_size=16,
                                                   patch_size=4))
        processor = CLIPImageProcessor(crop_size=32, size=32)
    pipe = WanImageToVideoPipeline(**parts, image_processor=processor, image_encoder=encoder,
                                   boundary_ratio=0.9 if two_experts else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_wan_ti2v_pipeline(as_shipped: bool = False):
    """Wan 2.2 TI2V-5B's shape (the 2.2 VAE, a transformer of 48 channels in and out, expand_timesteps, no image
    encoder) as WanImageToVideoPipeline, how its model card runs image-to-video; as_shipped: as WanPipeline, the
    class its checkpoint names."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    parts = _wan_parts(False, in_channels=48, wan22_vae=True)
    pipe = WanPipeline(**parts, expand_timesteps=True) if as_shipped else \
        WanImageToVideoPipeline(**parts, image_processor=None, image_encoder=None, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import durations_guard
    import extras_guard
    import xdist_order

    durations_guard.register(config)
    extras_guard.register(config)
    xdist_order.register(config)
