"""Trains dvllm's second built-in model, tiny-shapes-dit: a tiny SD3 (MMDiT, flow matching) on the shapes data.

    python scripts/train_tiny_shapes_dit.py                  # about 35 minutes on 2 idle CPU cores (0.57 s a step)
    python scripts/train_tiny_shapes_dit.py --threads 1      # the shipped weights: 49 min, 1 thread, busy machine
    python scripts/train_tiny_shapes_dit.py --out /tmp/dit --steps 100   # a quick try

The result is a StableDiffusion3Pipeline folder (fp16 safetensors) that dvllm and diffusers load:

- vae: the already-trained AutoencoderKL of the built-in tiny-shapes model (64x64 RGB <-> 16x16x4
  latents), trained by scripts/train_tiny_shapes.py and copied unchanged but for `shift_factor=0.0`
  (SD3's pipeline adds the shift on decode); its `scaling_factor` is kept.
- text_encoder, text_encoder_2: two tiny CLIPTextModelWithProjection, tokenizer and tokenizer_2 the
  tiny caption tokenizer (dvllm.tiny_shapes.tokenizer); no T5 (text_encoder_3 = None). Without T5 the
  pipeline appends `max_sequence_length` zero tokens to the CLIP tokens; this model is trained with
  MAX_SEQUENCE_LENGTH of them (dvllm_defaults.json tells dvllm; call diffusers with
  `max_sequence_length=MAX_SEQUENCE_LENGTH`). Training encodes captions with the pipeline's own
  `encode_prompt`, so it feeds exactly what sampling feeds.
- transformer: a small SD3Transformer2DModel, trained with the encoders on flow matching:
  x_t = (1 - t) x0 + t noise, predicting v = noise - x0 at timestep t * 1000 (as the pipeline passes
  the scheduler's sigmas). The target is exact: the posterior mean E[x0 | x_t, caption] over the 320
  scenes (dvllm.tiny_shapes.targets) replaces the one x0 drawn, so v = (x_t - E) / t. t is drawn as the
  sampler spaces it: u uniform, t = SHIFT u / (1 + (SHIFT - 1) u), with FlowMatchEulerDiscreteScheduler(shift=SHIFT).
- An EMA of the transformer and both encoders is what ships.

Everything is seeded: the same command (with the same --threads) gives the same weights.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import diffusers
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from dvllm.tiny_shapes.targets import CaptionSampler, all_scenes, posterior_mean, render_all
from dvllm.tiny_shapes.tokenizer import MAX_LENGTH, write_tokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_OUT = os.path.join(ROOT, "dvllm", "models", "builtin", "tiny-shapes-dit")
VAE_FOLDER = os.path.join(ROOT, "dvllm", "models", "builtin", "tiny-shapes", "vae")
MAX_SEQUENCE_LENGTH = 1  # the zero "T5" tokens the pipeline appends (one: a learnt register token)
SHIFT = 2.0  # FlowMatchEulerDiscreteScheduler's shift, used the same way for the training timesteps
TEXT_HIDDEN, TEXT_PROJECTION = 64, 64
INNER_DIM, HEAD_DIM, LAYERS = 128, 32, 6
LR, WARMUP, EMA_DECAY = 8e-4, 100, 0.999
# guidance 3.5: all 128 meaning cases right; 2.0 and 5.0 each miss one or two (python -m dvllm.tiny_shapes.meaning)
DEFAULTS = {"num_inference_steps": 28, "guidance_scale": 3.5, "height": 64, "width": 64,
            "max_sequence_length": MAX_SEQUENCE_LENGTH}


def build_text_encoder(vocab_size: int, eos: int, seed: int) -> CLIPTextModelWithProjection:
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_LENGTH, bos_token_id=eos - 1, eos_token_id=eos,
        pad_token_id=eos, projection_dim=TEXT_PROJECTION,
    ))


def build_transformer(seed: int) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=LAYERS,
        attention_head_dim=HEAD_DIM, num_attention_heads=INNER_DIM // HEAD_DIM,
        joint_attention_dim=2 * TEXT_HIDDEN, caption_projection_dim=INNER_DIM,
        pooled_projection_dim=2 * TEXT_PROJECTION, pos_embed_max_size=16,
    )


def load_vae() -> AutoencoderKL:
    vae = AutoencoderKL.from_pretrained(VAE_FOLDER, torch_dtype=torch.float32)
    vae.register_to_config(shift_factor=0.0)
    return vae.eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=3600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    # Captions naming a triangle, a position and the background run past the 16 CLIP tokens (the tokenizer
    # spells "triangle" letter by letter): the pipeline cuts ", on a white background" off, as it will when
    # serving, and would warn at every step.
    diffusers.utils.logging.set_verbosity_error()
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

    scenes = all_scenes()
    vae = load_vae()
    with torch.no_grad():
        config = vae.config
        latents = (vae.encode(render_all(scenes)).latent_dist.mean - config.shift_factor) * config.scaling_factor
    tokenizer = write_tokenizer(os.path.join(args.out, "tokenizer"))
    tokenizer_2 = write_tokenizer(os.path.join(args.out, "tokenizer_2"))
    eos = tokenizer.eos_token_id
    pipe = StableDiffusion3Pipeline(
        transformer=build_transformer(3), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), vae=vae,
        text_encoder=build_text_encoder(len(tokenizer), eos, 1), tokenizer=tokenizer,
        text_encoder_2=build_text_encoder(len(tokenizer_2), eos, 2), tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    trained = torch.nn.ModuleList([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]).train()
    ema = copy.deepcopy(trained).eval().requires_grad_(False)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in
              [("transformer", pipe.transformer), ("text_encoder", pipe.text_encoder),
               ("text_encoder_2", pipe.text_encoder_2), ("vae", vae)]}
    log(f"parameters {counts}; latents {tuple(latents.shape)} std {latents.std():.3f}")

    params = [p for p in trained.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 1e-2}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.99))
    steps = args.steps

    def rate(s: int) -> float:  # warmup, then cosine down to 5%
        return min(1.0, (s + 1) / WARMUP) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    sampler, gen = CaptionSampler(scenes, seed=4), torch.Generator().manual_seed(5)
    running = None
    for step in range(1, steps + 1):
        captions, allowed, picks = sampler.draw(args.batch_size)
        x0 = latents[picks]
        noise = torch.randn(x0.shape, generator=gen)
        u = torch.rand(args.batch_size, generator=gen)
        t = (SHIFT * u / (1 + (SHIFT - 1) * u)).clamp(min=1e-4)
        tt = t[:, None, None, None]
        noisy = (1 - tt) * x0 + tt * noise
        with torch.no_grad():
            mean = posterior_mean(noisy, 1 - t, t, latents, allowed)
        target = (noise - x0) + (x0 - mean) / tt
        embeds, _, pooled, _ = pipe.encode_prompt(
            captions, None, None, device=torch.device("cpu"), num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH)
        pred = pipe.transformer(hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False)[0]
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
        if step % 25 == 0 or step == steps:
            log(f"step {step}/{steps} loss {loss.item():.5f} avg {running:.5f} grad {grad_norm:.3f} "
                f"lr {schedule.get_last_lr()[0]:.2e}")

    pipe.transformer, pipe.text_encoder, pipe.text_encoder_2 = ema[0], ema[1], ema[2]
    pipe.register_modules(transformer=ema[0], text_encoder=ema[1], text_encoder_2=ema[2])
    pipe.to(torch.float16)  # a few MB to ship; dvllm loads it in the dtype it runs in
    pipe.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "dvllm_defaults.json"), "w") as f:
        json.dump(DEFAULTS, f, indent=1)
    log(f"saved to {args.out}")


if __name__ == "__main__":
    main()
