"""How long the denoise loop stalls when a cohort of requests finishes together, decode stage on vs off.

One run, the two engines interleaved round by round: a cohort of `--cohort` requests that finish at the same
step, and `--runners` longer requests submitted with them that keep the loop stepping after the cohort is done.
The loop's gaps are timed between consecutive denoiser forwards (the end of one to the start of the next); the
longest gap of a round is where the cohort's decode lands when the loop runs it. With the stage, the loop only
hands the latents over, and the VAE runs on the stage's thread (or, with --decode-workers N, in N processes of
its own).

    python -m dvllm.benchmarks.loop_stall --model tiny-sd --size 256 --cohort 16

Also reported: each round's wall time (the whole workload), and the cohort's images equal between the two.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.benchmarks.report import emit_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-sd", help="A preset, folder or Hub id (dummy weights for presets).")
    parser.add_argument("--size", type=int, default=256, help="Side of every image, in pixels.")
    parser.add_argument("--cohort", type=int, default=16, help="Requests that finish together.")
    parser.add_argument("--runners", type=int, default=2, help="Longer requests that keep the loop stepping.")
    parser.add_argument("--steps", type=int, default=4, help="The cohort's steps (the runners take 3x).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds per engine, interleaved.")
    parser.add_argument("--decode-workers", type=int, default=0,
                        help="Decode worker processes of the engine with the stage (0: the stage's thread decodes).")
    parser.add_argument("--decode-device", help="Where the decode workers run (cpu, cuda:N; unset: --device).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="Write the figures as JSON here.")
    return parser


def time_forwards(engine: DiffusionEngine, sync: bool = False) -> list[tuple[float, float]]:
    """(start, end) of each denoiser forward the engine runs from now on, appended to the list returned. sync: on
    CUDA, wait for the loop's stream before and after each forward, so that work the loop queued on it before a
    forward (a text encoder's) counts in the gap before that forward, and not in the forward."""
    forwards: list[tuple[float, float]] = []
    adapter = engine.executor.worker.runner.adapter
    real = adapter.denoise

    def wait() -> None:
        if sync:
            torch.cuda.current_stream().synchronize()

    def timed(*a: Any, **k: Any) -> Any:
        wait()
        start = time.perf_counter()
        out = real(*a, **k)
        wait()
        forwards.append((start, time.perf_counter()))
        return out

    adapter.denoise = timed
    return forwards


def run_off_on(args: argparse.Namespace, make: Callable[[argparse.Namespace, bool], DiffusionEngine],
               compare: Callable[[dict[str, DiffusionEngine], argparse.Namespace], dict[str, Any]]) -> dict[str, Any]:
    """The two engines a feature's benchmark compares (made with it off and on), `compare` run on them, both shut
    down whatever happens; the figures printed, written to args.output if set, and returned."""
    engines = {"off": make(args, False), "on": make(args, True)}
    try:
        result = compare(engines, args)
    finally:
        for engine in engines.values():
            engine.shutdown()
    emit_json(result, args.output)
    return result


def gaps(forwards: list[tuple[float, float]]) -> list[float]:
    """Seconds between consecutive forwards: the end of one to the start of the next."""
    return [nxt[0] - prev[1] for prev, nxt in zip(forwards, forwards[1:])]


def _engine(args: argparse.Namespace, stage: bool) -> DiffusionEngine:
    engine = DiffusionEngine(model=args.model, load_format="auto", device=args.device, decode_stage=stage,
                             decode_workers=args.decode_workers if stage else 0,
                             decode_device=args.decode_device if stage and args.decode_workers else None,
                             max_batch_size=2 * (args.cohort + args.runners), max_image_pixels=args.size ** 2,
                             max_decode_queue=max(32, args.cohort))
    engine.forwards = time_forwards(engine)  # type: ignore[attr-defined]
    return engine


def _round(engine: DiffusionEngine, args: argparse.Namespace, seed: int) -> tuple[float, float, list[np.ndarray]]:
    """(longest gap between forwards, wall seconds, the cohort's images)."""
    engine.forwards.clear()
    params = dict(height=args.size, width=args.size, guidance_scale=1.0, output_type="np")
    requests = [(f"c{i}", SamplingParams(seed=seed + i, num_inference_steps=args.steps, **params))
                for i in range(args.cohort)]
    requests += [(f"r{i}", SamplingParams(seed=seed + 100 + i, num_inference_steps=3 * args.steps, **params))
                 for i in range(args.runners)]
    start = time.perf_counter()
    outputs = engine.generate([f"shape {name}" for name, _ in requests], [p for _, p in requests], use_tqdm=False)
    wall = time.perf_counter() - start
    gap = max(gaps(engine.forwards))
    return gap, wall, [o.images[0] for o in outputs[:args.cohort]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_off_on(build_parser().parse_args(argv), _engine, _compare)


def _compare(engines: dict[str, DiffusionEngine], args: argparse.Namespace) -> dict[str, Any]:
    for engine in engines.values():  # warm up: kernels, the prompt cache
        _round(engine, args, 0)
    gaps: dict[str, list[float]] = {k: [] for k in engines}
    walls: dict[str, list[float]] = {k: [] for k in engines}
    worst_diff = 0.0
    for r in range(args.rounds):
        images = {}
        for name, engine in engines.items():
            gap, wall, images[name] = _round(engine, args, 1000 * (r + 1))
            gaps[name].append(gap)
            walls[name].append(wall)
        worst_diff = max(worst_diff, max(float(np.abs(a - b).max()) for a, b in zip(images["on"], images["off"])))
    result = {
        "model": args.model, "size": args.size, "cohort": args.cohort, "runners": args.runners, "steps": args.steps,
        "decode_workers": args.decode_workers, "decode_device": args.decode_device,
        "longest_gap_s": {k: statistics.median(v) for k, v in gaps.items()},
        "wall_s": {k: statistics.median(v) for k, v in walls.items()},
        "cohort_images_max_abs_diff": worst_diff,
    }
    result["gap_ratio_on_off"] = result["longest_gap_s"]["on"] / result["longest_gap_s"]["off"]
    result["wall_ratio_on_off"] = result["wall_s"]["on"] / result["wall_s"]["off"]
    return result

if __name__ == "__main__":
    main()
