"""A worker group's costs measured on one device, and the arithmetic they give for N GPUs (labelled as such).

A lent machine with one GPU cannot run a group of two (NCCL refuses two ranks on one GPU), so this measures the
parts a group's step is made of, on the preset's real transformer (random weights, built on the device):
- the forward of one row, and of two (what CFG-parallel splits: two rows on one GPU against one row on each);
- one forward's Ulysses exchanges (four all-to-alls a layer, each rank's shard of [tokens / N, width]) run as
  collectives of a one-rank process group on the device (NCCL on a GPU, gloo on the CPU): the launch and the
  on-device copy, without a link; and the same bytes as plain copies, to split NCCL's own overhead out.
Then, for N = 2, 4, 8 GPUs: the measured forward split N ways, plus the exchange's bytes over a link of
`--link-gbps` (arithmetic: the link is not measured), plus the measured per-collective overhead. That is an upper
bound on the gain (smaller per-GPU shapes run less efficiently), printed next to the peers' published scaling.

    python -m dvllm.benchmarks.group_on_device --preset flux-dev --size 1024 --text-tokens 512 --device cuda
    python -m dvllm.benchmarks.group_on_device --preset flux-cpu --size 128 --text-tokens 16 --device cpu \\
        --dtype float32 --rounds 1                                                   # a dry run on the CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dvllm.sizing.group_arithmetic import PUBLISHED, transformer_shape, ulysses_bytes_per_rank
from dvllm.benchmarks.report import emit_json
from dvllm.benchmarks.report import machine_label
from dvllm.models.loader import load_preset

DEGREES = (2, 4, 8)


def build_transformer(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's transformer with its constructor's random weights, built on `device` (fast on a GPU)."""
    import diffusers

    spec = load_preset(preset)
    _, class_name = spec["model_index"]["transformer"]
    if class_name != "FluxTransformer2DModel":
        raise ValueError(f"{preset}: this benchmark builds Flux transformers' inputs; {class_name} is not one")
    with torch.device(device):
        model = getattr(diffusers, class_name).from_config(spec["components"]["transformer"])
    return model.to(dtype).eval()


def flux_inputs(model: torch.nn.Module, rows: int, size: int, text_tokens: int) -> dict[str, torch.Tensor]:
    """Random inputs of a Flux forward at `size` x `size` (2x2-packed latents: a token per 16 pixels)."""
    config, param = model.config, next(model.parameters())
    tokens = (size // 16) ** 2
    like = dict(device=param.device, dtype=param.dtype)
    inputs = {
        "hidden_states": torch.randn(rows, tokens, config.in_channels, **like),
        "encoder_hidden_states": torch.randn(rows, text_tokens, config.joint_attention_dim, **like),
        "pooled_projections": torch.randn(rows, config.pooled_projection_dim, **like),
        "timestep": torch.full((rows,), 0.5, **like),
        "img_ids": torch.zeros(tokens, 3, **like),
        "txt_ids": torch.zeros(text_tokens, 3, **like),
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((rows,), 3.5, **like)
    return inputs


def _timed(device: torch.device, rounds: int, work: Callable[[], Any], warmup: int = 1) -> float:
    """The median seconds of `work` over `rounds` runs after `warmup` (the device synchronized around each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        work()
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exchange_seconds(device: torch.device, dtype: torch.dtype, shard_elements: int, count: int,
                     rounds: int) -> dict[str, float]:
    """`count` all-to-alls of a `shard_elements` shard on a one-rank group, and the same bytes as plain copies."""
    source = torch.randn(shard_elements, device=device, dtype=dtype)
    target = torch.empty_like(source)

    def collectives() -> None:
        for _ in range(count):
            dist.all_to_all_single(target, source)

    def copies() -> None:
        for _ in range(count):
            target.copy_(source)

    return {"collectives_s": _timed(device, rounds, collectives), "copies_s": _timed(device, rounds, copies)}


def forward_seconds(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[float, float, float]:
    """Seconds to build the transformer, and its forward's median seconds for one row and for two."""
    started = time.perf_counter()
    model = build_transformer(args.preset, device, dtype)  # first: it refuses a preset that is not a Flux
    built_s = time.perf_counter() - started
    with torch.inference_mode():
        one, two = (flux_inputs(model, rows, args.size, args.text_tokens) for rows in (1, 2))
        return (built_s, _timed(device, args.rounds, lambda: model(**one, return_dict=False)),
                _timed(device, args.rounds, lambda: model(**two, return_dict=False)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    built_s, forward_1, forward_2 = forward_seconds(args, device, dtype)  # the model freed before the exchanges
    shape = transformer_shape(args.preset, args.size, args.text_tokens)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    with tempfile.TemporaryDirectory(prefix="dvllm-group-") as folder:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{os.path.join(folder, 'init')}", rank=0, world_size=1)
        try:
            exchanges = {n: exchange_seconds(device, dtype, -(-shape.tokens // n) * shape.width, 4 * shape.layers,
                                             args.rounds) for n in DEGREES}
        finally:
            dist.destroy_process_group()
    rows = []
    for n, measured in exchanges.items():
        link_s = ulysses_bytes_per_rank(shape, n, element_bytes) / (args.link_gbps * 1e9)
        overhead_s = max(measured["collectives_s"] - measured["copies_s"], 0.0)
        step_s = forward_1 / n + link_s + overhead_s
        rows.append({"gpus": n, "compute_s": forward_1 / n, "link_s": link_s, "collective_overhead_s": overhead_s,
                     "on_device_collectives_s": measured["collectives_s"], "on_device_copies_s": measured["copies_s"],
                     "exchange_mb_per_rank": ulysses_bytes_per_rank(shape, n, element_bytes) / 1e6,
                     "step_s": step_s, "speedup_bound": forward_1 / step_s})
    output_bytes = shape.tokens * element_bytes * 64  # CFG-parallel gathers one row's output (Flux: 64 channels)
    return {
        "kind": "measured on one device; the N-GPU rows are arithmetic from those measurements and --link-gbps",
        "machine": machine_label(device, dtype), "preset": args.preset, "size": f"{args.size}x{args.size}",
        "dtype": args.dtype, "tokens": shape.tokens, "attention_layers": shape.layers, "width": shape.width,
        "parameters": shape.parameters, "built_s": built_s, "forward_1_row_s": forward_1,
        "forward_2_rows_s": forward_2, "link_gbps": args.link_gbps,
        "cfg_parallel": {"gather_mb": output_bytes / 1e6,
                         "speedup_bound": forward_2 / (forward_1 + output_bytes / (args.link_gbps * 1e9))},
        "sequence_parallel": rows, "published": PUBLISHED,
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"{result['preset']} at {result['size']} ({result['dtype']}, {result['tokens']} tokens, "
          f"{result['parameters'] / 1e9:.1f}B parameters) on {result['machine']}: built in {result['built_s']:.1f} s")
    print(f"  measured: one row's forward {result['forward_1_row_s'] * 1e3:.1f} ms, two rows' "
          f"{result['forward_2_rows_s'] * 1e3:.1f} ms")
    cfg = result["cfg_parallel"]
    print(f"  CFG-parallel on 2 GPUs (arithmetic from those): at most {cfg['speedup_bound']:.2f}x "
          f"({cfg['gather_mb']:.1f} MB gathered a step at {result['link_gbps']:.0f} GB/s)")
    for row in result["sequence_parallel"]:
        print(f"  Ulysses on {row['gpus']} GPUs: {row['exchange_mb_per_rank']:6.0f} MB a rank a forward; measured "
              f"on this device {row['on_device_collectives_s'] * 1e3:6.2f} ms as collectives, "
              f"{row['on_device_copies_s'] * 1e3:6.2f} ms as copies; arithmetic: compute "
              f"{row['compute_s'] * 1e3:6.1f} + link {row['link_s'] * 1e3:5.1f} + overhead "
              f"{row['collective_overhead_s'] * 1e3:5.2f} ms, at most {row['speedup_bound']:.2f}x")
    for p in result["published"]:
        print(f"  published, {p['who']}: {p['model']} {p['size']} on {p['gpus']}: {p['figure']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="flux-dev", help="a preset with a Flux transformer")
    parser.add_argument("--size", type=int, default=1024, help="the image's side in pixels")
    parser.add_argument("--text-tokens", type=int, default=512, help="the prompt's tokens in the joint sequence")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each measurement (the median)")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="GB/s per GPU and direction for the all-to-alls (NVLink 4: 900 GB/s both ways)")
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.size % 16:
        raise SystemExit("--size must be a multiple of 16 (Flux packs 2x2 latents of an 8x VAE)")
    result = run(args)
    print_report(result)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
