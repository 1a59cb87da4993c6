"""Writes a diffusers Stable Diffusion pipeline as one civitai-style checkpoint (original LDM/SGM key layout).

This is the inverse of diffusers' single-file converters (`diffusers.loaders.single_file_utils`), so tests can
build `model.safetensors` files offline and load them back with `from_single_file`:

    StableDiffusionPipeline.from_single_file(path, config=<save_pretrained folder>, local_files_only=True)
    StableDiffusionXLPipeline.from_single_file(path, config=<folder>, local_files_only=True, add_watermarker=False)

`config` must be the pipeline's diffusers folder: the checkpoint holds weights only, and without `config` diffusers
guesses the model type from a few keys at full-size positions (e.g. SDXL needs `...resblocks.9...`, which a 2-layer
test encoder lacks) and then downloads that type's configs from the Hub. `add_watermarker` is not in model_index.json,
so an SDXL caller passes it again. SDXL's two text encoders must differ in width (real ones are 768 and 1280):
diffusers picks text_encoder_2's weights by width and, when they are equal, loads text_encoder's instead.
"""
from __future__ import annotations

import torch
from conftest import tiny_sdxl_pipeline
from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from safetensors.torch import save_file
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

# A rename table maps a diffusers module prefix to (original prefix, leaf renames). Leaf renames apply to the
# module path below the prefix; None copies that path unchanged (e.g. UNet transformer blocks keep their names).
Renames = dict[str, tuple[str, dict[str, str] | None]]

_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_CLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
               "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def _rename(state: dict[str, torch.Tensor], renames: Renames) -> dict[str, torch.Tensor]:
    """Renames every key by its longest matching module prefix; a key no rule covers is an error, because
    diffusers' converter would silently drop it and the loaded model would differ from the original."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in renames:
                break
        else:
            raise ValueError(f"no original-layout name for {key!r}")
        target, leaves = renames[prefix]
        module, param = ".".join(parts[cut:-1]), parts[-1]
        if leaves is not None:
            if module not in leaves:
                raise ValueError(f"no original-layout name for {key!r}")
            module = leaves[module]
        out[".".join(p for p in (target, module, param) if p)] = value
    return out


def _unet_renames(unet: UNet2DConditionModel) -> Renames:
    cfg = unet.config
    per_block = cfg.layers_per_block
    if not isinstance(per_block, int):
        raise ValueError("the original UNet layout has one layers_per_block for every block")
    renames: Renames = {
        "conv_in": ("input_blocks.0.0", None), "conv_norm_out": ("out.0", None), "conv_out": ("out.2", None),
        "time_embedding.linear_1": ("time_embed.0", None), "time_embedding.linear_2": ("time_embed.2", None),
    }
    if cfg.addition_embed_type == "text_time":  # SDXL's size/crop conditioning MLP
        renames["add_embedding.linear_1"] = ("label_emb.0.0", None)
        renames["add_embedding.linear_2"] = ("label_emb.0.2", None)

    # input_blocks.0 is conv_in; each down block then takes per_block (resnet, attention) slots and a downsampler
    # slot, the last block has no downsampler.
    last_down = len(cfg.down_block_types) - 1
    for b, kind in enumerate(cfg.down_block_types):
        first = 1 + b * (per_block + 1)
        for j in range(per_block):
            renames[f"down_blocks.{b}.resnets.{j}"] = (f"input_blocks.{first + j}.0", _UNET_RESNET)
            if "CrossAttn" in kind:
                renames[f"down_blocks.{b}.attentions.{j}"] = (f"input_blocks.{first + j}.1", None)
        if b < last_down:
            renames[f"down_blocks.{b}.downsamplers.0.conv"] = (f"input_blocks.{first + per_block}.0.op", None)

    # middle_block alternates resnet, attention, resnet.
    if cfg.mid_block_type is not None:
        for j in range(len(unet.mid_block.resnets)):
            renames[f"mid_block.resnets.{j}"] = (f"middle_block.{2 * j}", _UNET_RESNET)
        for j in range(len(getattr(unet.mid_block, "attentions", []))):
            renames[f"mid_block.attentions.{j}"] = (f"middle_block.{2 * j + 1}", None)

    # Up blocks have per_block + 1 slots; the upsampler sits in the last slot after the resnet (and attention).
    last_up = len(cfg.up_block_types) - 1
    for b, kind in enumerate(cfg.up_block_types):
        first = b * (per_block + 1)
        attention = "CrossAttn" in kind
        for j in range(per_block + 1):
            renames[f"up_blocks.{b}.resnets.{j}"] = (f"output_blocks.{first + j}.0", _UNET_RESNET)
            if attention:
                renames[f"up_blocks.{b}.attentions.{j}"] = (f"output_blocks.{first + j}.1", None)
        if b < last_up:
            slot = 2 if attention else 1
            renames[f"up_blocks.{b}.upsamplers.0.conv"] = (f"output_blocks.{first + per_block}.{slot}.conv", None)
    return renames


def _vae_renames(vae: AutoencoderKL) -> Renames:
    cfg = vae.config
    renames: Renames = {}
    for side in ("encoder", "decoder"):
        renames[f"{side}.conv_in"] = (f"{side}.conv_in", None)
        renames[f"{side}.conv_out"] = (f"{side}.conv_out", None)
        renames[f"{side}.conv_norm_out"] = (f"{side}.norm_out", None)
        renames[f"{side}.mid_block.resnets.0"] = (f"{side}.mid.block_1", _VAE_RESNET)
        renames[f"{side}.mid_block.resnets.1"] = (f"{side}.mid.block_2", _VAE_RESNET)
        renames[f"{side}.mid_block.attentions.0"] = (f"{side}.mid.attn_1", _VAE_ATTENTION)
    renames["quant_conv"] = ("quant_conv", None)
    renames["post_quant_conv"] = ("post_quant_conv", None)

    blocks = len(cfg.block_out_channels)
    for b in range(blocks):
        for j in range(cfg.layers_per_block):
            renames[f"encoder.down_blocks.{b}.resnets.{j}"] = (f"encoder.down.{b}.block.{j}", _VAE_RESNET)
        renames[f"encoder.down_blocks.{b}.downsamplers.0.conv"] = (f"encoder.down.{b}.downsample.conv", None)
    # The original decoder numbers its up blocks from the lowest resolution's end: diffusers up_blocks.0 is up.{n-1}.
    for b in range(blocks):
        original = blocks - 1 - b
        for j in range(cfg.layers_per_block + 1):
            renames[f"decoder.up_blocks.{b}.resnets.{j}"] = (f"decoder.up.{original}.block.{j}", _VAE_RESNET)
        renames[f"decoder.up_blocks.{b}.upsamplers.0.conv"] = (f"decoder.up.{original}.upsample.conv", None)
    return renames


def _vae_layout(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    out = _rename(vae.state_dict(), _vae_renames(vae))
    # The original mid-block attention uses 1x1 convolutions where diffusers uses linear layers.
    for key, value in out.items():
        if ".mid.attn_1." in key and key.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight")):
            out[key] = value[:, :, None, None]
    return out


def _clip_layout(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face CLIP names, always under `text_model.` (transformers >= 5.6 drops it from CLIPTextModel)."""
    state = encoder.state_dict()
    flat = not hasattr(encoder, "text_model")
    out = {f"text_model.{k}" if flat else k: v for k, v in state.items()}
    # Original checkpoints carry the position ids; diffusers must tolerate them (transformers no longer saves them).
    positions = out["text_model.embeddings.position_embedding.weight"].shape[0]
    out["text_model.embeddings.position_ids"] = torch.arange(positions).unsqueeze(0)
    return out


def _open_clip_layout(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """OpenCLIP names for a CLIPTextModelWithProjection (SDXL's second text encoder)."""
    state = {k.removeprefix("text_model."): v for k, v in encoder.state_dict().items()}
    out = {
        "token_embedding.weight": state.pop("embeddings.token_embedding.weight"),
        "positional_embedding": state.pop("embeddings.position_embedding.weight"),
        "ln_final.weight": state.pop("final_layer_norm.weight"),
        "ln_final.bias": state.pop("final_layer_norm.bias"),
        # OpenCLIP multiplies by text_projection on the right; diffusers transposes it back into a Linear weight.
        "text_projection": state.pop("text_projection.weight").T.contiguous(),
    }
    renames: Renames = {}
    for layer in range(encoder.config.num_hidden_layers):
        layer_prefix = f"encoder.layers.{layer}"
        block = f"transformer.resblocks.{layer}"
        # OpenCLIP fuses q, k and v into one in_proj, stacked in that order.
        for kind in ("weight", "bias"):
            q, k, v = (state.pop(f"{layer_prefix}.self_attn.{p}_proj.{kind}") for p in "qkv")
            out[f"{block}.attn.in_proj_{kind}"] = torch.cat([q, k, v])
        renames[layer_prefix] = (block, _CLIP_LAYER)
    out.update(_rename(state, renames))
    return out


def _prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def original_layout(pipe: StableDiffusionPipeline | StableDiffusionXLPipeline) -> dict[str, torch.Tensor]:
    """The pipeline's weights in the single-file layout diffusers' `from_single_file` reads (SD 1.x or SDXL)."""
    out = _prefixed("model.diffusion_model.", _rename(pipe.unet.state_dict(), _unet_renames(pipe.unet)))
    out |= _prefixed("first_stage_model.", _vae_layout(pipe.vae))
    if isinstance(pipe, StableDiffusionXLPipeline):
        out |= _prefixed("conditioner.embedders.0.transformer.", _clip_layout(pipe.text_encoder))
        out |= _prefixed("conditioner.embedders.1.model.", _open_clip_layout(pipe.text_encoder_2))
    elif isinstance(pipe, StableDiffusionPipeline):
        out |= _prefixed("cond_stage_model.transformer.", _clip_layout(pipe.text_encoder))
    else:
        raise TypeError(f"no single-file layout for {type(pipe).__name__}")
    return out


def save_single_file(pipe: StableDiffusionPipeline | StableDiffusionXLPipeline, path: str) -> str:
    """Writes `original_layout(pipe)` to `path` as safetensors and returns the path."""
    # safetensors refuses tensors that share storage or are views, so every tensor gets its own contiguous copy.
    save_file({k: v.detach().contiguous().clone() for k, v in original_layout(pipe).items()}, str(path))
    return str(path)


def tiny_sdxl_two_widths() -> StableDiffusionXLPipeline:
    """conftest's tiny SDXL with text encoders 16 and 32 wide (as real SDXL's are 768 and 1280): diffusers tells
    the two encoders of a single file apart by width (see test_single_file_layout's equal-width test). 16 + 32 keeps the UNet's 48."""
    base = tiny_sdxl_pipeline()
    common = dict(intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=600,
                  max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513,
                  projection_dim=24, hidden_act="gelu")
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=16, **common))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=32, **common))
    pipe = StableDiffusionXLPipeline(**{**base.components, "text_encoder": text_encoder,
                                        "text_encoder_2": text_encoder_2},
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe
