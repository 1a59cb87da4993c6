"""Arithmetic, not a measurement: what a worker group of N GPUs would move and gain for one request of a preset's
real architecture, next to the published scaling of the peers (labelled as such).

Per forward, a sequence-parallel group (Ulysses) exchanges four all-to-alls around each attention layer (queries,
keys and values before it, its output after), each rank sending (N - 1) / N of its [tokens / N, heads x head dim]
shard; the forward's compute splits N ways. The compute is counted as 2 FLOPs per parameter per token plus
attention's 4 x tokens^2 x width per layer (its two matmuls), at an achieved rate (`--tflops`); the exchange at a
link bandwidth per GPU and direction (`--link-gbps`). The result is an upper bound on the gain: it leaves out the
smaller per-GPU shapes' lower efficiency, the collectives' latency, and the text encode and VAE decode (which a
group shares only in tiles).

A request with CFG runs two rows a forward. On N GPUs a group may give each row its own N / 2 GPUs (CFG-parallel
degree 2, sequence-parallel degree N / 2: each rank's exchanges are one row's at N / 2, and the guided output
crosses once), or split both rows' tokens N ways (degree 1 and N). Both are listed.

    python -m dvllm.sizing.group_arithmetic --preset flux-dev --size 1024 --text-tokens 512
    python -m dvllm.sizing.group_arithmetic --preset qwen-image --size 2048 --text-tokens 128
    python -m dvllm.sizing.group_arithmetic --preset wan2.2-t2v-a14b-mlperf   # its defaults: 720x1280, 81 frames
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from dvllm.models.loader import load_preset

# The peers' published scaling (from their announcements and docs; not measured here)
PUBLISHED = [
    {"who": "xDiT (USP)", "model": "FLUX.1-dev", "size": "1024x1024", "gpus": "4x H100", "speedup": 4.30 / 1.63,
     "figure": "4.30 s -> 1.63 s"},
    {"who": "vLLM-Omni (Ulysses)", "model": "Qwen-Image", "size": "2048x2048", "gpus": "8 GPUs", "speedup": 3.65,
     "figure": "3.65x"},
    {"who": "vLLM-Omni (CFG-parallel)", "model": "Qwen-Image", "size": "", "gpus": "2 GPUs", "speedup": [1.5, 1.8],
     "figure": "1.5-1.8x"},
]


@dataclass(frozen=True)
class Shape:
    """One request's forward: its tokens, the transformer's attention layers and width, its parameters."""

    tokens: int
    layers: int
    width: int  # heads x head dim
    parameters: int


def transformer_shape(preset: str, size: int | tuple[int, int], text_tokens: int, frames: int | None = None) -> Shape:
    """The preset's transformer at `size` (a side, or (height, width)) and, for a video model, `frames` (its
    parameters counted on the meta device: no weights). One expert of a two-expert model: one runs each step."""
    import diffusers
    import torch

    spec = load_preset(preset)
    _, class_name = spec["model_index"]["transformer"]
    config = spec["components"]["transformer"]
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config)
    parameters = sum(p.numel() for p in model.parameters())
    height, width = (size, size) if isinstance(size, int) else size
    layers = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    heads = config["num_attention_heads"] * config["attention_head_dim"]
    patch = config.get("patch_size", 1)
    if isinstance(patch, list):  # a video transformer's (frames, height, width) patch, over the VAE's latents
        vae = spec["components"]["vae"]
        scale, temporal = vae.get("scale_factor_spatial", 8), vae.get("scale_factor_temporal", 4)
        latent_frames = ((frames or 1) - 1) // temporal + 1
        tokens = latent_frames // patch[0] * (height // scale // patch[1]) * (width // scale // patch[2])
        # Wan's text is no part of the sequence: its cross-attention to the text (under 1% of the forward at 720p)
        # and its keys and values, the same on every rank, are left out
        return Shape(tokens=tokens, layers=layers, width=heads, parameters=parameters)
    # Flux packs 2x2 latents into one token (patch_size 1 over packed latents); the others patch by patch_size
    step = 8 * (2 if patch == 1 else patch)
    return Shape(tokens=(height // step) * (width // step) + text_tokens, layers=layers, width=heads,
                 parameters=parameters)


def ulysses_bytes_per_rank(shape: Shape, degree: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends in one forward: four all-to-alls a layer, (N - 1) / N of its shard each."""
    if degree == 1:
        return 0.0
    shard = shape.tokens / degree * shape.width * element_bytes
    return shape.layers * 4 * shard * (degree - 1) / degree


def forward_flops(shape: Shape) -> float:
    return 2 * shape.parameters * shape.tokens + 4 * shape.tokens ** 2 * shape.width * shape.layers


def predict(shape: Shape, degrees: list[int], tflops: float, link_gbps: float) -> list[dict[str, Any]]:
    alone = forward_flops(shape) / (tflops * 1e12)
    rows = []
    for n in degrees:
        compute = alone / n
        exchange = ulysses_bytes_per_rank(shape, n) / (link_gbps * 1e9)
        rows.append({"gpus": n, "compute_s": compute, "exchange_s": exchange,
                     "exchange_mb_per_rank": ulysses_bytes_per_rank(shape, n) / 1e6,
                     "speedup_bound": alone / (compute + exchange)})
    return rows


def predict_cfg(shape: Shape, gpus: list[int], tflops: float, link_gbps: float,
                out_features: int = 0) -> list[dict[str, Any]]:
    """A CFG request's two rows on each count of GPUs, both ways a group can split them: (CFG-parallel degree,
    sequence-parallel degree) = (1, N), and (2, N / 2) where N is even. `out_features`: numbers per token of the
    denoiser's output, which crosses between the two CFG halves once a forward."""
    alone = 2 * forward_flops(shape) / (tflops * 1e12)
    rows = []
    for n in gpus:
        for cfg in (1, 2) if n % 2 == 0 else (1,):
            sp = n // cfg
            sent = (2 // cfg) * ulysses_bytes_per_rank(shape, sp)
            if cfg == 2:
                sent += shape.tokens / sp * out_features * 2  # the unconditional half's output, in bf16
            compute, exchange = alone / n, sent / (link_gbps * 1e9)
            rows.append({"gpus": n, "cfg_degree": cfg, "sp_degree": sp, "compute_s": compute, "exchange_s": exchange,
                         "exchange_mb_per_rank": sent / 1e6, "step_s": compute + exchange,
                         "speedup_bound": alone / (compute + exchange)})
    return rows


def preset_request(preset: str) -> tuple[tuple[int, int], int | None, int]:
    """A preset's default request, as far as its JSON says: (height, width), frames, steps (1024x1024 and 20
    steps where it says nothing; frames only for a video model: 81, Wan's pipeline's default)."""
    spec = load_preset(preset)
    defaults = spec.get("defaults", {})
    video = isinstance(spec["components"]["transformer"].get("patch_size"), list)
    size = (defaults.get("height", 1024), defaults.get("width", 1024))
    return size, (defaults.get("num_frames", 81) if video else None), defaults.get("num_inference_steps", 20)


def run(args: argparse.Namespace) -> dict:
    size, frames, steps = preset_request(args.preset)
    size = size if args.size is None else _size(args.size)
    frames = frames if args.frames is None else args.frames
    shape = transformer_shape(args.preset, size, args.text_tokens, frames)
    transformer = load_preset(args.preset)["components"]["transformer"]
    patch = transformer.get("patch_size", 1)
    out_features = transformer.get("out_channels", 16) * (math.prod(patch) if isinstance(patch, list) else 1)
    cfg = predict_cfg(shape, [1, 2, 4, 8], args.tflops, args.link_gbps, out_features)
    return {"kind": "arithmetic, not measured", "preset": args.preset, "size": f"{size[0]}x{size[1]}",
            "frames": frames, "steps": steps, "tokens": shape.tokens, "attention_layers": shape.layers,
            "width": shape.width, "parameters": shape.parameters, "forward_tflop": forward_flops(shape) / 1e12,
            "assumed_tflops": args.tflops, "assumed_link_gbps": args.link_gbps,
            "sequence_parallel": predict(shape, [1, 2, 4, 8], args.tflops, args.link_gbps),
            "cfg_parallel": [{**row, "request_s": row["step_s"] * steps} for row in cfg],
            "published": PUBLISHED}


def _size(text: str) -> tuple[int, int]:
    """A side ("1024") or HEIGHTxWIDTH ("720x1280"); ValueError naming --size otherwise."""
    height, sep, width = text.partition("x")
    width = width if sep else height
    if not (height.isdigit() and width.isdigit() and int(height) > 0 and int(width) > 0):
        raise ValueError(f"--size must be a side or HEIGHTxWIDTH in pixels (1024, 720x1280), got {text!r}")
    return int(height), int(width)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="flux-dev")
    parser.add_argument("--size", default=None,
                        help="a side or HEIGHTxWIDTH in pixels (default: the preset's defaults, else 1024)")
    parser.add_argument("--frames", type=int, default=None,
                        help="a video's frames (default: the preset's defaults, else 81)")
    parser.add_argument("--text-tokens", type=int, default=512, help="the prompt's tokens in the joint sequence")
    parser.add_argument("--tflops", type=float, default=500.0,
                        help="achieved bf16 TFLOPS per GPU (an H200's dense peak is ~990; ~50%% is typical)")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="GB/s per GPU and direction for the all-to-alls (NVLink 4: 900 GB/s both ways)")
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    frames = f", {result['frames']} frames" if result["frames"] else ""
    print(f"{args.preset} at {result['size']}{frames}: {result['tokens']} tokens, {result['attention_layers']} "
          f"attention layers, {result['parameters'] / 1e9:.1f}B parameters, {result['forward_tflop']:.0f} TFLOP a "
          f"forward (arithmetic at {args.tflops:.0f} TFLOPS and {args.link_gbps:.0f} GB/s; not measured)")
    print(" one row, sequence parallel:")
    for row in result["sequence_parallel"]:
        print(f"  {row['gpus']} GPU(s): compute {row['compute_s'] * 1e3:7.1f} ms, exchange "
              f"{row['exchange_s'] * 1e3:5.1f} ms ({row['exchange_mb_per_rank']:6.0f} MB a rank), "
              f"at most {row['speedup_bound']:.2f}x")
    print(f" a CFG request (2 rows), {result['steps']} steps:")
    for row in result["cfg_parallel"]:
        print(f"  {row['gpus']} GPU(s), CFG x{row['cfg_degree']} SP x{row['sp_degree']}: step "
              f"{row['step_s']:8.3f} s (exchange {row['exchange_s'] * 1e3:6.1f} ms, {row['exchange_mb_per_rank']:6.0f} "
              f"MB a rank), {result['steps']} steps {row['request_s']:7.1f} s, at most {row['speedup_bound']:.2f}x")
    for p in PUBLISHED:
        print(f"  published, {p['who']}: {p['model']} {p['size']} on {p['gpus']}: {p['figure']}")
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
