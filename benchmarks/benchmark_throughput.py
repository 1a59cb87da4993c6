"""Offline throughput: serial diffusers pipeline vs the best static batch vs dvllm, in one run.

All three use the same diffusers pipeline object (the engine's own, so the same
weights), the same prompts, seeds and parameters, on the same machine, interleaved
round by round so that machine noise hits each alike. Prints images/s and ratios.

    python benchmarks/benchmark_throughput.py                     # tiny preset, 8 x 20 steps, CFG, 16x16
    python benchmarks/benchmark_throughput.py --model sd15 --size 512x512 --num-requests 32
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dvllm import DiffusionEngine, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--size", default="16x16", help="WxH")
    p.add_argument("--sampler", default=None)
    p.add_argument("--static-batch-sizes", default="1,2,4,8,16", help="Static batch sizes to try; the best counts.")
    p.add_argument("--rounds", type=int, default=3, help="Timed rounds (median reported), after one warm-up round.")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    engine = DiffusionEngine(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                             max_batch_size=max(16, 2 * args.num_requests))
    adapter = engine.executor.worker.runner.adapter
    pipe, device = adapter.pipeline, adapter.device
    if args.sampler:  # the diffusers baselines run the same scheduler dvllm's sampler names
        from dvllm.samplers import make_scheduler
        pipe.scheduler = make_scheduler(engine.model_info.scheduler_config, args.sampler)
    prompts = [f"a photo of object number {i}" for i in range(args.num_requests)]
    seeds = list(range(args.num_requests))
    common = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, height=height, width=width)

    def run_pipeline(batch_prompts: list[str], batch_seeds: list[int]) -> None:
        generators = [torch.Generator("cpu").manual_seed(s) for s in batch_seeds]
        pipe(batch_prompts, generator=generators, output_type="pil", **common)

    def serial() -> None:
        for prompt, seed in zip(prompts, seeds):
            run_pipeline([prompt], [seed])

    def static(batch: int):
        def run() -> None:
            for i in range(0, len(prompts), batch):
                run_pipeline(prompts[i:i + batch], seeds[i:i + batch])
        return run

    def dvllm() -> None:
        params = [SamplingParams(seed=s, sampler=args.sampler, **common) for s in seeds]
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs if o.error]

    def timed(fn) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    batch_sizes = [b for b in (int(x) for x in args.static_batch_sizes.split(",")) if b <= args.num_requests]
    contenders = {"serial": serial, **{f"static(b={b})": static(b) for b in batch_sizes}, "dvllm": dvllm}
    for fn in contenders.values():  # warm-up round: allocators, kernels, caches
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(timed(fn))
    ips = {name: args.num_requests / statistics.median(t) for name, t in times.items()}
    best_static = max((n for n in ips if n.startswith("static")), key=ips.get)

    print(f"\nmodel={args.model} requests={args.num_requests} steps={args.steps} guidance={args.guidance} "
          f"size={width}x{height} sampler={args.sampler or 'model default'} device={device} "
          f"dtype={adapter.dtype} torch={torch.__version__} cpu={platform.processor() or platform.machine()}")
    print(f"{'engine':<14}{'images/s':>10}{'vs serial':>11}{'vs best static':>16}")
    for name, value in ips.items():
        print(f"{name:<14}{value:>10.2f}{value / ips['serial']:>10.2f}x{value / ips[best_static]:>15.2f}x")
    summary = {"dvllm_vs_serial": ips["dvllm"] / ips["serial"], "dvllm_vs_best_static": ips["dvllm"] / ips[best_static],
               "best_static": best_static}
    print(f"\ndvllm / serial = {summary['dvllm_vs_serial']:.2f}x   "
          f"dvllm / best static ({best_static}) = {summary['dvllm_vs_best_static']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "images_per_s": ips, "seconds": times, **summary}, f, indent=2)


if __name__ == "__main__":
    main()
