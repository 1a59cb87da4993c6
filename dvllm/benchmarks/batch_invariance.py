"""How far batching moves an image on a GPU in half precision, and whether the largest step fits.

On the CPU in float32 a request's image equals its image alone to 1e-3 (tests/test_fidelity.py). On a
GPU in float16 or bfloat16, kernels chosen by batch size round differently, so the same request alone
and inside a mixed batch can differ slightly. This measures it: 8 requests that differ in steps,
guidance, sampler and seed, each generated alone and then all together, max abs difference on [0, 1]
images, per dtype. Then a stress run: full batches at the largest size max_image_pixels allows, kept
full for --stress-seconds; any out-of-memory error fails it.

    python -m dvllm.benchmarks.batch_invariance --output-json invariance.json       # sd15 on CUDA
    python -m dvllm.benchmarks.batch_invariance --dry-run                            # tiny-sd on the CPU
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker.memory_profile import largest_size

SAMPLERS = [None, "euler", "euler_a", "dpmpp_2m", "ddim", "dpmpp_2m_karras", "euler", None]


def mixed_requests(size: int) -> list[tuple[str, SamplingParams]]:
    return [(f"a photo of object {i}", SamplingParams(num_inference_steps=6 + i, guidance_scale=3.0 + i, seed=100 + i,
                                                      sampler=SAMPLERS[i], height=size, width=size, output_type="np"))
            for i in range(8)]


def invariance(model: str, device: str, dtype: str, size: int) -> dict:
    engine = DiffusionEngine(model=model, load_format="dummy", device=device, dtype=dtype, max_batch_size=16)
    jobs = mixed_requests(size)
    alone = [engine.generate(prompt, params, use_tqdm=False)[0] for prompt, params in jobs]
    together = engine.generate([p for p, _ in jobs], [q for _, q in jobs], use_tqdm=False)
    diffs = [float(np.abs(a.images[0] - b.images[0]).max()) for a, b in zip(alone, together)]
    engine.shutdown()
    return {"dtype": dtype, "size": size, "max_abs_diff": max(diffs), "mean_max_abs_diff": float(np.mean(diffs)),
            "per_request": diffs}


def stress(model: str, device: str, dtype: str, seconds: float, max_batch_size: int) -> dict:
    engine = DiffusionEngine(model=model, load_format="dummy", device=device, dtype=dtype,
                             max_batch_size=max_batch_size)
    info = engine.model_info
    side = largest_size(info, info.pixel_limit(engine.config.max_image_pixels))[0]
    params = SamplingParams(num_inference_steps=4, guidance_scale=5.0, height=side, width=side, output_type="latent")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start, ids, done, errors = time.perf_counter(), 0, 0, []
    while time.perf_counter() - start < seconds or engine.has_unfinished_requests():
        while time.perf_counter() - start < seconds and engine.stats()["num_running"] + \
                engine.stats()["num_waiting"] < max_batch_size:  # CFG: each request is 2 rows; keep the queue full
            engine.add_request(f"stress-{ids}", "a large image", SamplingParams(**{**params.__dict__, "seed": ids}))
            ids += 1
        for out in engine.step():
            if out.finished:
                done += 1
                if out.error:
                    errors.append(out.error)
    result = {"size": f"{side}x{side}", "native": f"{info.defaults.width}x{info.defaults.height}",
              "seconds": time.perf_counter() - start, "images": done, "errors": errors[:5], "ok": not errors}
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        result.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, total_gib=total / 2**30)
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny-sd on the CPU in float32, to check the script")
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--stress-seconds", type=float, default=60.0)
    parser.add_argument("--output-json", default="batch_invariance.json")
    args = parser.parse_args(argv)
    model, device, dtypes, size = ("tiny-sd", "cpu", ["float32"], 16) if args.dry_run else \
        (args.model, "cuda", ["float16", "bfloat16"], 512)
    results = {"invariance": [invariance(model, device, d, size) for d in dtypes]}
    for r in results["invariance"]:
        print(f"{model} {r['dtype']} {size}x{size}: alone vs mixed batch of 8, max abs diff {r['max_abs_diff']:.2e} "
              f"(mean over requests {r['mean_max_abs_diff']:.2e})", flush=True)
    seconds, rows = (1.0, 4) if args.dry_run else (args.stress_seconds, 16)
    results["stress"] = stress(model, device, dtypes[0], seconds, rows)
    s = results["stress"]
    print(f"stress {s['size']}, full batches for {s['seconds']:.0f} s: {s['images']} images, "
          f"{'no error' if s['ok'] else 'ERRORS: ' + '; '.join(s['errors'])}"
          + (f", peak {s['peak_gib']:.1f} of {s['total_gib']:.1f} GiB" if "peak_gib" in s else ""), flush=True)
    with open(args.output_json, "w") as f:
        json.dump(results, f, indent=2)
    if not s["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
