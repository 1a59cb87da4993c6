"""Does a model draw what it is asked? Prompts over every colour x shape, some naming a size, a
position or both, on seeds the training never used (1000 and up), read back with `read_scene`. A video
model (tiny-shapes-video) gets every colour x shape x motion, some naming a size, at NUM_FRAMES frames,
read back with `read_video`: colour, shape and size from the middle frame, the motion from the shape's
move between the first frame and the last.

    python -m dvllm.tiny_shapes.meaning --model tiny-shapes-dit
    python -m dvllm.tiny_shapes.meaning --model tiny-shapes-video
    python -m dvllm.tiny_shapes.meaning --model tiny-shapes-dit --seeds 1000,2000,3000 \
        --cache '{"method": "first_block", "threshold": 0.05}' --cache '{"method": "taylorseer"}'

With --cache, one row per cache (and one without) of a markdown table: each attribute's share right,
and the share of denoising steps the cache skipped (what a user trades).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dvllm.tiny_shapes.data import COLORS, POSITIONS, SHAPES, SIZES
from dvllm.tiny_shapes.reader import Reading, read_scene, read_video
from dvllm.tiny_shapes.video import MOTIONS, NUM_FRAMES

# Evaluation seeds start here: training draws its noise from one seeded stream of its own, and the
# images and tests before these models used seeds 0-31.
HELD_OUT_SEED = 1000
FORMS = ("plain", "size", "position", "size and position")


@dataclass(frozen=True)
class Case:
    prompt: str
    colour: str
    shape: str
    size: str | None
    position: str | None
    seed: int
    motion: str | None = None  # a video's


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def cases(forms: Sequence[str] = FORMS, seed: int = HELD_OUT_SEED) -> list[Case]:
    """Every colour x shape in each form; the size and position asked are drawn with a fixed seed."""
    rng = random.Random(seed)
    out = []
    for form, (colour, shape) in itertools.product(forms, itertools.product(COLORS, SHAPES)):
        size = rng.choice(list(SIZES)) if "size" in form else None
        position = rng.choice(list(POSITIONS)) if "position" in form else None
        words = [w for w in (size, colour, shape, position) if w]
        out.append(Case(f"{article(words[0])} {' '.join(words)}", colour, shape, size, position, seed + len(out)))
    return out


def video_cases(seed: int = HELD_OUT_SEED) -> list[Case]:
    """Every colour x shape x motion; about half name a size, drawn with a fixed seed."""
    rng = random.Random(seed)
    out = []
    for colour, shape, motion in itertools.product(COLORS, SHAPES, MOTIONS):
        size = rng.choice(list(SIZES)) if rng.random() < 0.5 else None
        words = [w for w in (size, colour, shape, motion) if w]
        out.append(Case(f"{article(words[0])} {' '.join(words)}", colour, shape, size, None, seed + len(out), motion))
    return out


def model_cases(engine: Any, seed: int = HELD_OUT_SEED) -> tuple[list[Case], dict[str, Any]]:
    """The cases for an engine's model and the request fields they need: videos for a video model."""
    if engine.model_info.video is None:
        return cases(seed=seed), {}
    return video_cases(seed), {"num_frames": NUM_FRAMES}


def score(asked: Sequence[Case], readings: Sequence[Reading],
          motions: Sequence[str | None] | None = None) -> dict[str, float]:
    """The share right of each attribute, over the cases that ask for it; `clean` over all. A video's
    position is not asked (it moves): the position and motion columns are there when some case asks."""
    def share(pairs: list[tuple[Any, Any]]) -> float:
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan")

    both = list(zip(asked, readings))
    scores = {
        "colour": share([(c.colour, r.colour) for c, r in both]),
        "shape": share([(c.shape, r.shape) for c, r in both]),
        "size": share([(c.size, r.size) for c, r in both if c.size]),
        "position": share([(c.position, r.position) for c, r in both if c.position]),
        "clean": share([(True, r.clean) for _, r in both]),
    }
    if any(c.motion for c in asked):
        del scores["position"]
        moved = zip(asked, motions or [None] * len(asked))
        scores["motion"] = share([(c.motion, m) for c, m in moved if c.motion])
    return scores


def evaluate(engine: Any, asked: Sequence[Case], cache: dict[str, Any] | None = None,
             **params: Any) -> tuple[dict[str, float], list[np.ndarray]]:
    """Scores and images of one engine on the cases, in one mixed batch at the model's defaults. With a
    cache, the scores add `skipped`: the share of the requests' denoising steps the cache skipped."""
    from dvllm import SamplingParams

    sampling = [SamplingParams(seed=c.seed, output_type="np", cache=cache, **params) for c in asked]
    outs = engine.generate([c.prompt for c in asked], sampling, use_tqdm=False)
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    images = [np.asarray(o.images[0]) for o in outs]
    if images[0].ndim == 4:  # videos: [frames, H, W, 3]
        videos = [read_video(v) for v in images]
        scores = score(asked, [v.scene for v in videos], [v.motion for v in videos])
    else:
        scores = score(asked, [read_scene(i) for i in images])
    if cache is not None:
        steps = params.get("num_inference_steps") or engine.model_info.defaults.steps
        scores["skipped"] = sum(o.metrics.cached_steps for o in outs) / (steps * len(outs))
    return scores, images


def cache_table(engine: Any, caches: Sequence[dict[str, Any] | None], seeds: Sequence[int]) -> list[str]:
    """Markdown rows: for each cache (None: off), every attribute's share right over the cases of all the
    seed sets, the share of steps skipped, and how far its images move from the uncached ones (mean
    absolute difference of [0, 1] pixels, same seeds)."""
    off = [evaluate(engine, asked, **params) for asked, params in (model_cases(engine, seed) for seed in seeds)]
    names = list(off[0][0])
    header = ["cache", *names, "steps skipped", "mean abs diff vs off"]
    rows = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    uncached = [images for _, images in off]
    for cache in caches:
        runs = off if cache is None else [evaluate(engine, asked, cache, **params)
                                          for asked, params in (model_cases(engine, seed) for seed in seeds)]
        mean = {k: sum(r[0][k] for r in runs) / len(runs) for k in runs[0][0]}
        moved = np.mean([np.abs(a - b).mean() for (_, images), plain in zip(runs, uncached)
                         for a, b in zip(images, plain)])
        label = "off" if cache is None else ", ".join(f"{k}={v}" for k, v in cache.items())
        rows.append(f"| {label} | " + " | ".join(f"{mean[k]:.1%}" for k in names)
                    + f" | {mean.get('skipped', 0.0):.1%} | {moved:.4f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--cache", action="append", default=[],
                        help="a step cache as JSON, e.g. '{\"method\": \"taylorseer\"}' (repeatable: a table)")
    parser.add_argument("--seeds", default=str(HELD_OUT_SEED), help="first seeds of the case sets, comma-separated")
    parser.add_argument("--max-batch-size", type=int, default=64)
    args = parser.parse_args()
    from dvllm import DiffusionEngine

    engine = DiffusionEngine(model=args.model, max_batch_size=args.max_batch_size)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.cache:
        print("\n".join(cache_table(engine, [None, *(json.loads(c) for c in args.cache)], seeds)))
        return
    for seed in seeds:
        asked, params = model_cases(engine, seed)
        scores, _ = evaluate(engine, asked, **params)
        print(json.dumps({"model": args.model, "seed": seed, **scores}))


if __name__ == "__main__":
    main()
