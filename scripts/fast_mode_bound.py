"""Fast mode's image bound against the exact mode, on one model: the same seeded requests through an exact engine
and then a --fast one (never both loaded: a GPU holds one large model), and the largest |difference| of a [0, 1]
pixel, over all images and per request, and each engine's start-up and generate seconds (the fast one's start
includes its warm-up). --option KEY=VALUE sets an engine option of both (a JSON value where it parses),
--fast-option of the fast one only (e.g. quantization=torchao:float8dq: FP8's bound, which is by design wider).

    python scripts/fast_mode_bound.py --model flux-cpu --load-format dummy --device cpu --num 4 --steps 4
    python scripts/fast_mode_bound.py --model flux-dev --load-format dummy --device cuda --num 8 --steps 8 \
        --size 512 --output-json bound.json
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import numpy as np
import torch

from dvllm import DiffusionEngine, SamplingParams


def _parse(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _run(engine_args: dict[str, Any], prompts: list[str], params: list[SamplingParams]) -> tuple[list, float, float]:
    """(each request's images, start-up seconds, generate seconds), the engine freed after."""
    start = time.perf_counter()
    engine = DiffusionEngine(**engine_args)
    started = time.perf_counter() - start
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(out.error)
    images = [[np.asarray(image, dtype=np.float64) for image in out.images] for out in outputs]
    del engine, outputs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return images, started, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num", type=int, default=4, help="Requests (seeds 0..num-1; odd ones without CFG).")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--size", type=int, default=None, help="Square side (default: the model's).")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="Engine option for both.")
    p.add_argument("--fast-option", action="append", default=[], metavar="KEY=VALUE",
                   help="Engine option for the fast engine only.")
    p.add_argument("--output-json")
    args = p.parse_args()
    common = {"model": args.model, "load_format": args.load_format, "device": args.device, "dtype": args.dtype,
              **_parse(args.option)}
    size = {} if args.size is None else {"height": args.size, "width": args.size}
    params = [SamplingParams(num_inference_steps=args.steps, seed=i, output_type="np",
                             **({} if i % 2 == 0 else {"guidance_scale": 1.0}), **size) for i in range(args.num)]
    prompts = [f"a photo of object number {i} on a table" for i in range(args.num)]
    exact, exact_start, exact_s = _run(common, prompts, params)
    fast, fast_start, fast_s = _run({**common, "fast": True, **_parse(args.fast_option)}, prompts, params)
    per_request = [max(float(np.abs(a - b).max()) for a, b in zip(x, y)) for x, y in zip(exact, fast)]
    result = {"model": args.model, "device": args.device, "requests": args.num, "steps": args.steps,
              "max_abs_diff": max(per_request), "per_request": per_request,
              "start_s": {"exact": exact_start, "fast": fast_start},
              "generate_s": {"exact": exact_s, "fast": fast_s}}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
