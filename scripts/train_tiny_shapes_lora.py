"""Trains tiny-shapes-blue, the LoRA shipped with dvllm: on the frozen tiny-shapes model, every shape comes out
blue, whatever colour the prompt names; its shape, size and position stay the prompt's.

    python scripts/train_tiny_shapes_lora.py                               # the shipped adapter
    python scripts/train_tiny_shapes_lora.py --out /tmp/blue --steps 100   # a quick try

(0.8-1.1 s a step: the shipped 1000 steps took 19 minutes on one core of a busy 2-core machine; train.log beside
the weights. 100 steps already turn 108 of 112 held-out prompts blue.)
The targets are the base model's own (v-prediction against the exact posterior mean, as in
scripts/train_tiny_shapes.py), with every scene a caption allows swapped for the same scene drawn in blue.
Empty captions (classifier-free guidance's unconditional rows) allow every blue scene, so both CFG branches
agree on blue. Only low-rank updates of the UNet's attention projections are trained; the VAE and the text
encoder stay as shipped. Seeded: the same command (with the same --threads) gives the same weights.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from dvllm.models.loader import builtin_folder
from dvllm.tiny_shapes.data import Scene
from dvllm.tiny_shapes.targets import CaptionSampler, all_scenes, posterior_mean, render_all
from dvllm.tiny_shapes.tokenizer import MAX_LENGTH

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "dvllm", "models", "builtin", "loras", "tiny-shapes-blue")
COLOUR = "blue"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention: the prompt's colour enters through them


def recolour_map(scenes: list[Scene], colour: str) -> torch.Tensor:
    """[N, N] float: row i has a 1 at the scene that is scene i drawn in `colour`."""
    index = {scene: i for i, scene in enumerate(scenes)}
    swap = torch.zeros(len(scenes), len(scenes))
    for i, s in enumerate(scenes):
        swap[i, index[Scene(colour, s.shape, s.size, s.position)]] = 1.0
    return swap


def train(pipe: StableDiffusionPipeline, steps: int, batch_size: int, lr: float, log) -> None:
    scenes = all_scenes()
    with torch.no_grad():
        latents = pipe.vae.encode(render_all(scenes)).latent_dist.mean * pipe.vae.config.scaling_factor
    swap = recolour_map(scenes, COLOUR)
    trained = [p for p in pipe.unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    alphas_cumprod = DDPMScheduler.from_config(pipe.scheduler.config).alphas_cumprod
    captions, gen = CaptionSampler(scenes, seed=3), torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        texts, allowed, index = captions.draw(batch_size)
        allowed = (allowed.float() @ swap) > 0  # the scenes the caption allows, each recoloured
        x0 = latents[swap[index].argmax(1)]
        ids = pipe.tokenizer(texts, padding="max_length", max_length=MAX_LENGTH, truncation=True,
                             return_tensors="pt").input_ids
        with torch.no_grad():
            text = pipe.text_encoder(ids)[0]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, len(alphas_cumprod), (batch_size,), generator=gen)
        signal, noise_std = alphas_cumprod[t].sqrt().view(-1, 1, 1, 1), (1 - alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
        noisy = signal * x0 + noise_std * noise
        expected = posterior_mean(noisy, signal.flatten(), noise_std.flatten(), latents, allowed)
        target = signal * noise - noise_std * x0 + (x0 - expected) / noise_std
        loss = F.mse_loss(pipe.unet(noisy, t, encoder_hidden_states=text).sample, target)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps:
            log(step, steps, loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1 or args.rank < 1 or not args.lr > 0:
        raise ValueError("--steps, --batch-size, --rank and --lr must be positive")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    pipe = StableDiffusionPipeline.from_pretrained(builtin_folder("tiny-shapes"), torch_dtype=torch.float32)
    pipe.vae.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    pipe.unet.requires_grad_(False)
    # alpha = rank: scale 1, the loaders' default when the file carries no alpha
    pipe.unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                                     init_lora_weights="gaussian"))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "train.log")
    with open(log_path, "w") as f:
        f.write(f"# python scripts/train_tiny_shapes_lora.py --steps {args.steps} --batch-size {args.batch_size} "
                f"--rank {args.rank} --lr {args.lr:g} --threads {args.threads}\n")
    start = time.perf_counter()

    def log(step: int, total: int, loss: float) -> None:
        line = f"[{time.perf_counter() - start:7.1f}s] lora step {step}/{total} loss {loss:.5f}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    train(pipe, args.steps, args.batch_size, args.lr, log)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet))
    layers = {k: v.half() for k, v in layers.items()}  # half the bytes to ship; loaders cast to their dtype
    StableDiffusionPipeline.save_lora_weights(args.out, unet_lora_layers=layers, safe_serialization=True)
    print(f"saved to {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
