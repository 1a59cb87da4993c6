"""Trains dvllm's third built-in model, tiny-shapes-video: a tiny Wan 2.1 (WanPipeline) that draws one shape
moving to the right, to the left, up or down, 9 frames of 32x32 px.

    python scripts/train_tiny_shapes_video.py                   # the shipped weights: 27 min on 2 CPU cores
    python scripts/train_tiny_shapes_video.py --vae-steps 20 --steps 20 --out /tmp/v   # a quick try

The shipped run (train.log): VAE 900 steps in 17 min (0.4 s a step on idle cores; the machine was shared for
part of it), transformer 1800 steps at 0.35 s a step (10.5 min). Frames are 32x32 px: 64x64 px (0.8 s a
transformer step, 1.4 s a VAE step) did not fit the hour on shared cores.

The result is a WanPipeline folder (fp16 safetensors) that dvllm and diffusers load. The data are the 256
videos of dvllm.tiny_shapes.video (8 colours x 4 shapes x 2 sizes x 4 motions), captioned like
"a small red circle moving to the right".

- vae: a tiny AutoencoderKLWan (3 levels: 4x spatial and 4x temporal compression; 9x32x32 RGB <-> 8 channels
  x 3 latent frames x 8x8), trained first on the 256 videos to reconstruct them (MSE on the posterior mean,
  no KL: only the mean is ever used). Its `latents_mean` / `latents_std` are the per-channel statistics of
  the encoded videos, so the diffusion sees unit-scale latents, as the pipeline's decode undoes them.
- tokenizer, text_encoder: a word-level T5-style tokenizer over the captions' words
  (dvllm.tiny_shapes.tokenizer.write_t5_tokenizer) and a tiny UMT5EncoderModel, trained with the transformer.
  The pipeline pads the text embeddings with zeros to max_sequence_length (512, as dvllm serves Wan), and
  the transformer attends to all of them: training feeds exactly that (the encoder runs on 16 tokens, whose
  masked outputs equal those at 512, and the zeros are appended).
- transformer: a small WanTransformer3DModel (6 blocks of width 128; patch 1x2x2: 3x4x4 = 48 video tokens), trained on flow
  matching: x_t = (1 - t) x0 + t noise, predicting v = noise - x0 at timestep t * 1000. The target is
  exact: the posterior mean E[x0 | x_t, caption] over the 256 videos (dvllm.tiny_shapes.targets) replaces
  the one x0 drawn, so v = (x_t - E) / t. t is drawn as the sampler spaces it: u uniform,
  t = SHIFT u / (1 + (SHIFT - 1) u), with UniPCMultistepScheduler(flow_prediction, flow_shift=SHIFT) as
  the Wan 2.1 checkpoints ship. 10% of captions are empty: the unconditional model guidance subtracts.
- An EMA of the transformer and the text encoder is what ships.

Everything is seeded: the same command (with the same --threads) gives the same weights.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from dvllm.tiny_shapes.reader import read_scene, read_video
from dvllm.tiny_shapes.targets import CaptionSampler, posterior_mean
from dvllm.tiny_shapes.tokenizer import write_t5_tokenizer
from dvllm.tiny_shapes.video import (
    MOTIONS,
    VIDEO_SIZE,
    all_video_scenes,
    render_all_videos,
    video_vocabulary,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_OUT = os.path.join(ROOT, "dvllm", "models", "builtin", "tiny-shapes-video")
MAX_SEQUENCE_LENGTH = 512  # what dvllm serves Wan with (WanPipeline's default): the zero padding is part of the input
ENCODE_LENGTH = 16  # the captions' tokens fit; the masked encoder's outputs do not depend on the padding
SHIFT = 3.0
Z_DIM, VAE_DIM = 8, 12
TEXT_DIM = 64
INNER_DIM, HEAD_DIM, LAYERS = 128, 32, 6
VAE_LR, LR, WARMUP, EMA_DECAY = 2e-3, 8e-4, 100, 0.999
DEFAULTS = {"num_inference_steps": 20, "guidance_scale": 4.0, "height": VIDEO_SIZE, "width": VIDEO_SIZE}


def build_vae(seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=VAE_DIM, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[True, True], latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM,
                            scale_factor_temporal=4, scale_factor_spatial=4)


def build_text_encoder(vocab_size: int, seed: int) -> UMT5EncoderModel:
    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=16, d_ff=2 * TEXT_DIM,
                                       num_layers=2, num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=16,
                                       relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1,
                                       decoder_start_token_id=0))


def build_transformer(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=INNER_DIM // HEAD_DIM,
                                 attention_head_dim=HEAD_DIM, in_channels=Z_DIM, out_channels=Z_DIM, text_dim=TEXT_DIM,
                                 freq_dim=256, ffn_dim=2 * INNER_DIM, num_layers=LAYERS, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def cosine(steps: int, warmup: int):
    def rate(s: int) -> float:  # warmup, then cosine down to 5%
        return min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    return rate


def read_back(videos: torch.Tensor, scenes) -> dict[str, float]:
    """Share of videos ([N, 3, F, H, W] in [-1, 1]) whose middle frame shows the scene's colour and shape,
    and whose shape moves the scene's way."""
    frames = ((videos.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).numpy()
    right = {"colour": 0, "shape": 0, "motion": 0}
    for video, scene in zip(frames, scenes):
        middle = read_scene(video[len(video) // 2])
        right["colour"] += middle.colour == scene.color
        right["shape"] += middle.shape == scene.shape
        right["motion"] += read_video(video).motion == scene.motion
    return {k: v / len(scenes) for k, v in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--vae-steps", type=int, default=900)
    parser.add_argument("--vae-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "train.log")
    if os.path.exists(log_path):
        os.remove(log_path)
    start = time.perf_counter()

    def log(line: str) -> None:
        line = f"[{time.perf_counter() - start:7.1f}s] {line}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    scenes = all_video_scenes()
    videos = render_all_videos(scenes, VIDEO_SIZE)

    # 1. the VAE
    vae = build_vae(1).train()
    log(f"vae parameters {sum(p.numel() for p in vae.parameters())}; videos {tuple(videos.shape)}")
    optimizer = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.vae_steps, 20))
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(len(scenes), generator=gen)
    cursor, running = 0, None
    for step in range(1, args.vae_steps + 1):
        if cursor + args.vae_batch_size > len(order):
            order, cursor = torch.randperm(len(scenes), generator=gen), 0
        batch = videos[order[cursor:cursor + args.vae_batch_size]]
        cursor += args.vae_batch_size
        z = vae.encode(batch).latent_dist.mean
        out = vae.decode(z).sample
        loss = (out - batch).square().mean() + 0.1 * (out - batch).abs().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % 20 == 0 or step == args.vae_steps:
            log(f"vae step {step}/{args.vae_steps} loss {loss.item():.5f} avg {running:.5f} grad {grad_norm:.3f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(videos[i:i + 16]).latent_dist.mean for i in range(0, len(videos), 16)])
        mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
        vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                               latents_std=[round(float(v), 5) for v in std])
        mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)
        latents = (z - mean) / std
        decoded = torch.cat([vae.decode(z[i:i + 16]).sample for i in range(0, len(z), 16)])
    log(f"vae reconstruction mse {(decoded - videos).square().mean():.5f}; read back "
        f"{read_back(decoded, scenes)}; latents {tuple(latents.shape)}")

    # 2. the text encoder and transformer
    tokenizer = write_t5_tokenizer(os.path.join(args.out, "tokenizer"), video_vocabulary())
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=build_text_encoder(len(tokenizer), 3), vae=vae,
                       transformer=build_transformer(4),
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         flow_shift=SHIFT))
    pipe.set_progress_bar_config(disable=True)
    trained = torch.nn.ModuleList([pipe.transformer, pipe.text_encoder]).train()
    ema = copy.deepcopy(trained).eval().requires_grad_(False)
    log(f"parameters transformer {sum(p.numel() for p in pipe.transformer.parameters())}, "
        f"text_encoder {sum(p.numel() for p in pipe.text_encoder.parameters())}")
    params = list(trained.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 1e-2}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.steps, WARMUP))
    sampler, gen = CaptionSampler(scenes, 5, "motion", MOTIONS), torch.Generator().manual_seed(6)
    running, dit_start = None, time.perf_counter()
    for step in range(1, args.steps + 1):
        captions, allowed, picks = sampler.draw(args.batch_size)
        x0 = latents[picks]
        noise = torch.randn(x0.shape, generator=gen)
        u = torch.rand(args.batch_size, generator=gen)
        t = (SHIFT * u / (1 + (SHIFT - 1) * u)).clamp(min=1e-4)
        tt = t[:, None, None, None, None]
        noisy = (1 - tt) * x0 + tt * noise
        with torch.no_grad():
            expected = posterior_mean(noisy, 1 - t, t, latents, allowed)
        target = (noise - x0) + (x0 - expected) / tt
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                       max_sequence_length=ENCODE_LENGTH, device=torch.device("cpu"))
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, MAX_SEQUENCE_LENGTH - ENCODE_LENGTH))
        pred = pipe.transformer(hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=embeds,
                                return_dict=False)[0]
        loss = (pred - target).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            d = min(EMA_DECAY, (1 + step) / (10 + step))
            for e, p in zip(ema.parameters(), trained.parameters()):
                e.lerp_(p, 1 - d)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % 25 == 0 or step == args.steps:
            log(f"step {step}/{args.steps} loss {loss.item():.5f} avg {running:.5f} grad {grad_norm:.3f} "
                f"lr {schedule.get_last_lr()[0]:.2e} ({(time.perf_counter() - dit_start) / step:.2f} s/step)")

    pipe.register_modules(transformer=ema[0], text_encoder=ema[1])
    pipe.to(torch.float16)  # a few MB to ship; dvllm loads it in the dtype it runs in
    pipe.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "dvllm_defaults.json"), "w") as f:
        json.dump(DEFAULTS, f, indent=1)
    log(f"saved to {args.out}")


if __name__ == "__main__":
    main()
