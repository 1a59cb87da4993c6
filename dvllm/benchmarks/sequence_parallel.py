"""One large request on a worker group (sequence_parallel_size N, or cfg_parallel_size N with --split rows) vs
one worker, in one run.

Two engines serve the same request (same prompt, seed, size), taking turns round by round: one worker, and a
group of N (the worker and N-1 member processes). Every process runs `--threads` torch threads, so on N cores
the group has N times the compute of the worker alone, as N GPUs would: the ratio is what the split gains after
its exchanges (Ulysses: all-to-alls around each attention). Reports each round's latency and the seconds its
denoiser forwards took (the part a group splits; the text encode runs on the worker alone, and the VAE decode is
shared out only in tiles, --vae-tile-size, or in rows), the median ratios, and how far apart the two engines'
images are (the split reorders float sums: ~1e-6 in float32). With --vae-tile-size both engines decode in tiles
of that size (the same image); the group shares the tiles out (group_decode). With --lora-rank R the request
takes a random rank-R adapter on the denoiser's attention (benchmarks/lora_adapters.py), on both engines: the
group's members apply it to their share of the tokens or rows.

    python -m dvllm.benchmarks.sequence_parallel --model flux-cpu --height 1024 --width 1024
    python -m dvllm.benchmarks.sequence_parallel --model flux-cpu --height 1024 --width 1024 --vae-tile-size 512
    python -m dvllm.benchmarks.sequence_parallel --split rows --model sd15 --height 512 --width 512 --guidance 7.5
    python -m dvllm.benchmarks.sequence_parallel --model flux-cpu --height 1024 --width 1024 --lora-rank 16
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from dvllm.benchmarks.lora_adapters import make_adapter
from dvllm.benchmarks.report import emit_json
from dvllm.benchmarks.throughput import _machine
from dvllm.engine.engine import DiffusionEngine
from dvllm.sampling_params import SamplingParams


def _latency(engine: DiffusionEngine, params: SamplingParams) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = engine.generate("a lighthouse on a cliff at dusk", params, use_tqdm=False)[0]
    if out.error is not None:
        raise RuntimeError(out.error)
    return time.perf_counter() - start, out.images[0]


def _forward_seconds(engine: DiffusionEngine) -> float:
    return engine.executor.worker.phase_seconds().get("forward", 0.0)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)  # the worker's threads; a group's members take as many each
    common = dict(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                  profile_steps=True)  # the forwards' seconds (on a GPU it synchronizes each phase: both alike)
    if args.vae_tile_size:
        common.update(vae_tiling=True, vae_tile_size=args.vae_tile_size)
    if args.lora_rank:
        common.update(enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank)
    engines = {"one worker": DiffusionEngine(**common)}
    folder = tempfile.TemporaryDirectory(prefix="dvllm-sp-lora-")
    try:
        size = {"sequence_parallel_size" if args.split == "tokens" else "cfg_parallel_size": args.degree}
        engines[f"group of {args.degree}"] = DiffusionEngine(**common, **size)
        loras = None
        if args.lora_rank:
            path = make_adapter(engines["one worker"].executor.worker.runner.adapter.pipeline, folder.name, seed=0,
                                rank=args.lora_rank)
            for engine in engines.values():
                engine.load_lora("bench", path)
            loras = {"bench": 1.0}
        params = SamplingParams(num_inference_steps=args.steps, seed=0, height=args.height, width=args.width,
                                guidance_scale=args.guidance, output_type="np", loras=loras)
        warm = SamplingParams(num_inference_steps=1, seed=0, height=args.height, width=args.width, loras=loras)
        for engine in engines.values():
            _latency(engine, warm)
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        forwards: dict[str, list[float]] = {name: [] for name in engines}
        images: dict[str, np.ndarray] = {}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                before = _forward_seconds(engine)
                took, images[name] = _latency(engine, params)
                seconds[name].append(took)
                forwards[name].append(_forward_seconds(engine) - before)
        worker = engines["one worker"].executor.worker
        machine = _machine(worker.device, worker.dtype)
    finally:
        for engine in reversed(list(engines.values())):
            engine.shutdown()
        folder.cleanup()
    one, group = (statistics.median(s) for s in seconds.values())
    one_forward, group_forward = (statistics.median(s) for s in forwards.values())
    first, second = images.values()
    return {
        "model": args.model, "size": f"{args.height}x{args.width}", "steps": args.steps, "guidance": args.guidance,
        "split": args.split, "degree": args.degree, "vae_tile_size": args.vae_tile_size,
        "lora_rank": args.lora_rank,
        "threads_per_process": args.threads, "rounds": args.rounds, "machine": machine,
        "latency_s": {name: [round(s, 3) for s in runs] for name, runs in seconds.items()},
        "forward_s": {name: [round(s, 3) for s in runs] for name, runs in forwards.items()},
        "latency_ratio": round(group / one, 3),  # the group's median over one worker's
        "forward_ratio": round(group_forward / one_forward, 3),
        "max_abs_image_diff": float(np.abs(first - second).max()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-cpu")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--degree", type=int, default=2, help="the group's size")
    parser.add_argument("--split", choices=("tokens", "rows"), default="tokens",
                        help="tokens: sequence_parallel_size; rows: cfg_parallel_size (a CFG request's two rows)")
    parser.add_argument("--guidance", type=float, default=None, help="the request's guidance_scale")
    parser.add_argument("--vae-tile-size", type=int, default=None,
                        help="both engines decode in tiles of this many pixels a side, the group's shared out")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="the request takes a random adapter of this rank (0: no LoRA)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
