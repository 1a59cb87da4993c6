"""Production-shaped request traces, generated here from a seed (no download), written as the JSONL that
`dvllm bench serve --workload trace` replays (workloads.trace_workload reads it).

- `images`: shaped like DiffusionDB (the 14M prompts and settings of Stable Diffusion's Discord users): most
  requests at the bot's defaults (512x512, 50 steps, guidance 7), the rest spread over 512 to 1024 px sides at
  several aspect ratios, 4 to 50 steps and guidance 1 to 15. The shares are ours, chosen to that shape, not
  measured from the dataset.
- `loras`: the images trace where each request carries a list of 0-3 adapters, as in the public production
  trace of SwiftDiffusion (Katz): adapters drawn from a pool (32 by default) with Zipf popularity, so a few are
  in most requests and most are rare, each at its own weight. The server must serve adapters of those names
  (lora00, lora01, ...).
- `cache`: the images trace where a share of requests asks for step caching, first_block or TaylorSeer, each at
  its own setting (a Flux, SD3, Qwen-Image, Z-Image or Wan model: the families that serve it).
- `--controls SHARE` (images, loras, cache): that share of the requests carries ControlNet controls, one for
  three in four of them and two for the rest, as in SwiftDiffusion's trace (control_inputs.py); the server must
  serve controlnets of those names (control0, control1, ...). The requests are the trace's without it, plus their
  controls.
- `video`: Wan clips behind each other: 832x480 (Wan 2.1's default), 480x832 and 480x480, 17 to 81 frames, 50
  steps with CFG for most, the rest fewer, and a share at 4 steps without CFG (a distilled LoRA's settings).
  Sides are divided by `size_divisor` and rounded down to a multiple of 16 (Wan's latent patches); frame counts
  are kept.
- `uniform` and `mixed`: offline throughput's workloads. uniform: every request alike (512x512, 20 steps, guidance
  7.5); mixed: 512 or 1024 px squares, 10, 20 or 30 steps, guidance 7.5 or 1 (no CFG), drawn per request.
- `stall`: what stalls a step loop. A quarter of the requests (at least one), the runners, start at once and take
  50 steps; the rest arrive together 1/rate seconds later (rate inf: with them), each with a long prompt and
  negative prompt of its own (CFG), and finish together 20 steps on: their encode and their decode both land while
  the runners step (an encode stage and a decode stage take them off the loop; `--forward-gaps` times the loop).

Arrivals are Poisson at `rate` requests/s (inf: all at once). `size_divisor` divides every side (8: 512 px
becomes 64 px, a tiny CPU model's size) so the mix keeps its shape where the model is small.

    dvllm bench trace loras --num 200 --rate 2 --size-divisor 8 -o loras.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from dvllm.benchmarks.captions import caption
from dvllm.benchmarks.control_inputs import draw_controls
from dvllm.benchmarks.workloads import arrival_times

KINDS = ("images", "loras", "cache", "video", "uniform", "mixed", "stall")
# (share, sides): the default size, then square, portrait and landscape sizes up to 1024 px
_SIZES = [(0.55, (512, 512)), (0.12, (768, 768)), (0.08, (1024, 1024)), (0.08, (512, 768)), (0.07, (768, 512)),
          (0.05, (576, 1024)), (0.05, (1024, 576))]
_STEPS = [(0.6, 50), (0.12, 20), (0.1, 30), (0.08, 25), (0.05, 8), (0.05, 4)]
_VIDEO_SIZES = [(0.6, (832, 480)), (0.2, (480, 832)), (0.2, (480, 480))]
_VIDEO_FRAMES = [(0.5, 81), (0.25, 49), (0.15, 33), (0.1, 17)]
_VIDEO_SETTINGS = [(0.6, (50, 5.0)), (0.15, (30, 5.0)), (0.1, (20, 6.0)), (0.15, (4, 1.0))]  # (steps, guidance)
_GUIDANCE = [(0.6, 7.0), (0.15, 7.5), (0.1, 5.0), (0.05, 9.0), (0.05, 12.0), (0.05, 15.0)]
_LORA_COUNTS = [(0.4, 0), (0.35, 1), (0.17, 2), (0.08, 3)]
ZIPF_EXPONENT = 1.1
_CACHES = [{"method": "first_block", "threshold": t} for t in (0.05, 0.08, 0.12, 0.2)] + \
          [{"method": "taylorseer", "cache_interval": i, "max_order": 1} for i in (3, 4, 5)]


def _pick(rng: random.Random, table: list[tuple[float, Any]]) -> Any:
    return rng.choices([value for _, value in table], weights=[share for share, _ in table])[0]


def zipf_weights(count: int, exponent: float = ZIPF_EXPONENT) -> list[float]:
    """Popularity of ranks 1..count: rank k is asked 1/k^exponent as often as the first."""
    weights = [1.0 / (k ** exponent) for k in range(1, count + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def generate(kind: str, num: int, rate: float, *, seed: int = 0, size_divisor: int = 1, lora_pool: int = 32,
             cache_share: float = 0.3, max_steps: int | None = None, max_frames: int | None = None,
             control_share: float = 0.0, control_pool: int = 2) -> list[dict[str, Any]]:
    """The trace's lines, in arrival order; steps and frames at most `max_steps` and `max_frames` where given (a
    short run of the same mix); `control_share` of an image trace's requests with controls of `control_pool`
    controlnets."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    sides = sorted({s for _, x in _SIZES for s in x} if kind in ("images", "loras", "cache") else {512, 1024})
    if size_divisor < 1 or (kind != "video" and any(side % (size_divisor * 8) for side in sides)):
        raise ValueError(f"size_divisor must divide the sizes ({sides}) into multiples of 8; {size_divisor} does not")
    if lora_pool < 1 or not 0 <= cache_share <= 1:
        raise ValueError("lora_pool must be at least 1 and cache_share in [0, 1]")
    if not 0 <= control_share <= 1 or control_pool < 1:
        raise ValueError("controls: a share in [0, 1], and control_pool at least 1")
    if control_share and kind not in ("images", "loras", "cache"):
        raise ValueError(f"controls: for the image traces (images, loras, cache), not {kind}")
    if (max_steps is not None and max_steps < 1) or (max_frames is not None and (max_frames - 1) % 4):
        raise ValueError("max_steps must be at least 1 and max_frames 4k + 1 (Wan's frames)")
    rng = random.Random(seed)
    control_rng = random.Random(f"controls {seed}")  # its own draws: the requests are the same without controls
    popularity = zipf_weights(lora_pool)
    lines = []
    for index, arrival in enumerate(arrival_times(num, rate, seed=seed)):
        if kind == "video":
            lines.append(_video_line(rng, arrival, size_divisor))
            continue
        if kind in ("uniform", "mixed", "stall"):
            lines.append(_throughput_line(kind, rng, index, num, rate, arrival, size_divisor))
            continue
        width, height = (side // size_divisor for side in _pick(rng, _SIZES))
        line: dict[str, Any] = {"prompt": caption(rng), "size": f"{width}x{height}", "steps": _pick(rng, _STEPS),
                                "guidance": _pick(rng, _GUIDANCE), "seed": rng.randrange(2**31),
                                "arrival": round(arrival, 6)}
        if kind == "loras":
            count = _pick(rng, _LORA_COUNTS)
            chosen: dict[str, float] = {}
            while len(chosen) < count:
                rank = rng.choices(range(lora_pool), weights=popularity)[0]
                chosen.setdefault(f"lora{rank:02d}", round(rng.uniform(0.4, 1.0), 2))
            if chosen:
                line["loras"] = chosen
        if kind == "cache" and rng.random() < cache_share:
            line["cache"] = dict(rng.choice(_CACHES))
        controls = draw_controls(control_rng, control_share, control_pool)
        if controls:
            line["controls"] = controls
        lines.append(line)
    for line in lines:
        if max_steps is not None:
            line["steps"] = min(line["steps"], max_steps)
        if max_frames is not None and "frames" in line:
            line["frames"] = min(line["frames"], max_frames)
    return lines


def _video_line(rng: random.Random, arrival: float, size_divisor: int) -> dict[str, Any]:
    width, height = (max(16, side // size_divisor // 16 * 16) for side in _pick(rng, _VIDEO_SIZES))
    steps, guidance = _pick(rng, _VIDEO_SETTINGS)
    return {"prompt": caption(rng), "size": f"{width}x{height}", "frames": _pick(rng, _VIDEO_FRAMES),
            "steps": steps, "guidance": guidance, "seed": rng.randrange(2**31), "arrival": round(arrival, 6)}


def _throughput_line(kind: str, rng: random.Random, index: int, num: int, rate: float, arrival: float,
                     size_divisor: int) -> dict[str, Any]:
    side, steps, guidance = 512, 20, 7.5
    if kind == "mixed":
        side, steps, guidance = rng.choice((512, 1024)), rng.choice((10, 20, 30)), rng.choice((7.5, 1.0))
    line: dict[str, Any] = {"prompt": f"a photo of object number {index}", "size": f"{side // size_divisor}x"
                            f"{side // size_divisor}", "steps": steps, "guidance": guidance, "seed": index,
                            "arrival": round(arrival, 6)}
    if kind == "stall":
        runner = index < max(1, num // 4)
        line.update(arrival=0.0 if runner or rate == float("inf") else round(1 / rate, 6), steps=50 if runner else 20)
        if not runner:  # texts of their own, several captions long: every one is encoded
            line.update(prompt=" ".join(caption(rng) for _ in range(4)),
                        negative_prompt=" ".join(caption(rng) for _ in range(2)))
    return line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS, help="images, loras (0-3 adapters a request), cache (a share cached), "
                   "video (Wan clips), uniform or mixed (offline throughput) or stall (a burst while others run).")
    p.add_argument("--num", type=int, default=200, help="Requests (default: 200).")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s; inf: all at once.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size-divisor", type=int, default=1, help="Divide every side by this (8 for tiny models).")
    p.add_argument("--lora-pool", type=int, default=32, help="Adapters named lora00.. (default: 32).")
    p.add_argument("--cache-share", type=float, default=0.3, help="Share of requests with a step cache (cache).")
    add_control_args(p)
    add_clamps(p)
    p.add_argument("-o", "--output", required=True, help="The JSONL file to write.")


def add_control_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controls", type=float, default=0.0, metavar="SHARE",
                   help="Share of an image trace's requests with ControlNet controls (one, a quarter of them two), "
                        "naming controlnets control0.. (default: 0).")
    p.add_argument("--control-pool", type=int, default=2, help="Controlnets named control0.. (default: 2).")


def add_clamps(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clamp-steps", type=int, help="Steps at most this many (a short run of the same mix).")
    p.add_argument("--clamp-frames", type=int, help="A video's frames at most this many (4k + 1).")


def main(args: argparse.Namespace) -> int:
    lines = generate(args.kind, args.num, args.rate, seed=args.seed, size_divisor=args.size_divisor,
                     lora_pool=args.lora_pool, cache_share=args.cache_share, max_steps=args.clamp_steps,
                     max_frames=args.clamp_frames, control_share=args.controls, control_pool=args.control_pool)
    Path(args.output).write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} requests written to {args.output} ({args.kind}, {args.rate:g}/s)")
    return 0
