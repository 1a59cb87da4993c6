"""Arithmetic, not a measurement: what a worker group of N GPUs would move and gain for one request of a preset's
real architecture, next to the published scaling of the peers (labelled as such).

Per forward, a sequence-parallel group (Ulysses) exchanges four all-to-alls around each attention layer (queries,
keys and values before it, its output after), each rank sending (N - 1) / N of its [tokens / N, heads x head dim]
shard; the forward's compute splits N ways. The compute is counted as 2 FLOPs per parameter per token plus
attention's 4 x tokens^2 x width per layer (its two matmuls), at an achieved rate (`--tflops`); the exchange at a
link bandwidth per GPU and direction (`--link-gbps`). The result is an upper bound on the gain: it leaves out the
smaller per-GPU shapes' lower efficiency, the collectives' latency, and the text encode and VAE decode (which a
group shares only in tiles).

    python -m dvllm.sizing.group_arithmetic --preset flux-dev --size 1024 --text-tokens 512
    python -m dvllm.sizing.group_arithmetic --preset qwen-image --size 2048 --text-tokens 128
"""
from __future__ import annotations

import argparse
import json
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


def transformer_shape(preset: str, size: int, text_tokens: int) -> Shape:
    """The preset's transformer at `size` x `size` (its parameters counted on the meta device: no weights)."""
    import diffusers
    import torch

    spec = load_preset(preset)
    _, class_name = spec["model_index"]["transformer"]
    config = spec["components"]["transformer"]
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config)
    parameters = sum(p.numel() for p in model.parameters())
    patch = config.get("patch_size", 1)
    # Flux packs 2x2 latents into one token (patch_size 1 over packed latents); the others patch by patch_size
    side = size // 8 // (2 if patch == 1 else patch)
    layers = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return Shape(tokens=side * side + text_tokens, layers=layers, width=width, parameters=parameters)


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


def run(args: argparse.Namespace) -> dict:
    shape = transformer_shape(args.preset, args.size, args.text_tokens)
    return {"kind": "arithmetic, not measured", "preset": args.preset, "size": f"{args.size}x{args.size}",
            "tokens": shape.tokens, "attention_layers": shape.layers, "width": shape.width,
            "parameters": shape.parameters, "forward_tflop": forward_flops(shape) / 1e12,
            "assumed_tflops": args.tflops, "assumed_link_gbps": args.link_gbps,
            "sequence_parallel": predict(shape, [1, 2, 4, 8], args.tflops, args.link_gbps),
            "published": PUBLISHED}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="flux-dev")
    parser.add_argument("--size", type=int, default=1024, help="the image's side in pixels")
    parser.add_argument("--text-tokens", type=int, default=512, help="the prompt's tokens in the joint sequence")
    parser.add_argument("--tflops", type=float, default=500.0,
                        help="achieved bf16 TFLOPS per GPU (an H200's dense peak is ~990; ~50%% is typical)")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="GB/s per GPU and direction for the all-to-alls (NVLink 4: 900 GB/s both ways)")
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{args.preset} at {result['size']}: {result['tokens']} tokens, {result['attention_layers']} attention "
          f"layers, {result['parameters'] / 1e9:.1f}B parameters, {result['forward_tflop']:.0f} TFLOP a forward "
          f"(arithmetic at {args.tflops:.0f} TFLOPS and {args.link_gbps:.0f} GB/s; not measured)")
    for row in result["sequence_parallel"]:
        print(f"  {row['gpus']} GPU(s): compute {row['compute_s'] * 1e3:7.1f} ms, exchange "
              f"{row['exchange_s'] * 1e3:5.1f} ms ({row['exchange_mb_per_rank']:6.0f} MB a rank), "
              f"at most {row['speedup_bound']:.2f}x")
    for p in PUBLISHED:
        print(f"  published, {p['who']}: {p['model']} {p['size']} on {p['gpus']}: {p['figure']}")
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
