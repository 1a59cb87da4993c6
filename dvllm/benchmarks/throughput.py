"""Offline throughput: serial diffusers pipeline vs the best static batch vs dvllm, in one run.

All three use the same diffusers pipeline object (the engine's own, so the same weights),
the same requests, seeds and parameters, on the same machine, interleaved round by round
so that machine noise hits each alike. Static batching can only group requests that
agree on everything the pipeline takes once per call (steps, guidance, size, sampler);
on a mixed workload it runs each such group in its own batches. Prints images/s and ratios.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from dvllm.engine.engine import DiffusionEngine
from dvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Job:
    prompt: str
    seed: int
    steps: int
    guidance: float
    height: int
    width: int
    sampler: str | None = None

    @property
    def group(self) -> tuple:
        """What one static pipeline call must share."""
        return (self.steps, self.guidance, self.height, self.width, self.sampler)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--workload", choices=("fixed", "mixed"), default="fixed",
                   help="fixed: every request alike; mixed: steps, CFG on/off and two sizes vary")
    p.add_argument("--prompts", choices=("numbered", "shapes"), default="numbered",
                   help="numbered: 'a photo of object number i'; shapes: the tiny-shapes meaning prompts (for the "
                        "built-in models, whose features then evolve as on real work)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--size", default="16x16", help="WxH (fixed workload; mixed adds twice this size)")
    p.add_argument("--sampler", default=None)
    p.add_argument("--static-batch-sizes", default="1,2,4,8,16,32", help="Static batch sizes to try; the best counts.")
    p.add_argument("--max-batch-size", type=int, default=None, help="dvllm rows per forward (default: all at once)")
    p.add_argument("--rounds", type=int, default=3, help="Timed rounds (median reported), after one warm-up round.")
    p.add_argument("--profile", action="store_true", help="Also split dvllm's steps into phases (an extra run).")
    p.add_argument("--compile", default="off", help="dvllm's compile mode (off | dynamic | bucketed)")
    p.add_argument("--cuda-graph", action="store_true", help="dvllm replays CUDA graphs")
    p.add_argument("--executor", choices=("uniproc", "ray"), default="uniproc",
                   help="ray: compare in-process vs Ray with 1 and --num-workers workers instead")
    p.add_argument("--num-workers", type=int, default=2, help="Ray workers (with --executor ray)")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    p.add_argument("--cache", default=None,
                   help="Step caching instead: dvllm with and without this cache (e.g. first_block:threshold=0.1, "
                        "taylorseer) against the diffusers pipeline with the same cache, and the step cost "
                        "against the rows that compute (Flux and Qwen-Image models)")
    p.add_argument("--loras", type=int, default=0,
                   help="Multi-LoRA instead: N random adapters, requests round-robin over them; dvllm mixing them in "
                        "one batch against dvllm without LoRA, one adapter at a time, and the diffusers pipeline "
                        "switching adapters per request or batching per adapter; and the step cost with N adapters")
    p.add_argument("--lora-rank", type=int, default=16, help="With --loras: the adapters' rank")
    p.add_argument("--cost-rows", type=int, default=16,
                   help="With --cache or --loras: the batch the step cost is measured at")
    p.add_argument("--cost-rounds", type=int, default=3, help="With --cache or --loras: timed rounds of the step cost")
    p.add_argument("--output-json", default=None)


def job_prompts(args: argparse.Namespace) -> list[str]:
    if getattr(args, "prompts", "numbered") == "shapes":
        from dvllm.tiny_shapes.meaning import cases

        shapes = [c.prompt for c in cases()]
        return [shapes[(7 * i) % len(shapes)] for i in range(args.num_requests)]  # stride 7: mixed colours and forms
    return [f"a photo of object number {i}" for i in range(args.num_requests)]


def make_jobs(args: argparse.Namespace) -> list[Job]:
    width, height = (int(v) for v in args.size.lower().split("x"))
    prompts = job_prompts(args)
    if args.workload == "fixed":
        return [Job(prompts[i], i, args.steps, args.guidance, height, width, args.sampler)
                for i in range(args.num_requests)]
    rng = random.Random(0)
    steps = [args.steps // 2, args.steps, args.steps + args.steps // 2]
    return [Job(prompts[i], i, rng.choice(steps), rng.choice([args.guidance, 1.0]),
                *rng.choice([(height, width), (2 * height, 2 * width)]), args.sampler)
            for i in range(args.num_requests)]


def make_engine(args: argparse.Namespace, rows: int, **extra) -> DiffusionEngine:
    return DiffusionEngine(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                           max_batch_size=rows, compile=args.compile, cuda_graph=args.cuda_graph, **extra)


def run(args: argparse.Namespace, engine: DiffusionEngine | None = None) -> dict:
    """Times serial, static and dvllm on args' workload; `engine` (reused across runs) must fit its rows."""
    jobs = make_jobs(args)
    rows = args.max_batch_size or max(16, 2 * len(jobs))
    engine = engine or make_engine(args, rows)
    adapter = engine.executor.worker.runner.adapter
    pipe, device = adapter.pipeline, adapter.device
    if args.sampler:  # the diffusers baselines run the scheduler dvllm's sampler name means
        from dvllm.samplers import make_scheduler
        pipe.scheduler = make_scheduler(engine.model_info.schedule.config, args.sampler)

    def pipeline(batch: list[Job]) -> None:
        j = batch[0]
        pipe([b.prompt for b in batch], num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height,
             width=j.width, generator=[torch.Generator("cpu").manual_seed(b.seed) for b in batch], output_type="pil")

    def dvllm() -> None:
        params = [SamplingParams(num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height,
                                 width=j.width, seed=j.seed, sampler=j.sampler) for j in jobs]
        outs = engine.generate([j.prompt for j in jobs], params, use_tqdm=False)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} dvllm requests failed: {failed[:3]}")

    sizes = [b for b in (int(x) for x in args.static_batch_sizes.split(",")) if b <= len(jobs)]
    contenders = {"serial": lambda: [pipeline([j]) for j in jobs],
                  **{f"static(b={b})": static_batches(jobs, pipeline, b) for b in sizes if b > 1}, "dvllm": dvllm}
    for fn in contenders.values():  # warm-up round: allocators, kernels, caches, compilation
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(_timed(fn, device))
    images = len(jobs)
    ips = {name: images / statistics.median(t) for name, t in times.items()}
    statics = [n for n in ips if n.startswith("static")] or ["serial"]
    best_static = max(statics, key=ips.get)
    result = {
        "machine": _machine(device, adapter.dtype), "args": vars(args), "jobs": [asdict(j) for j in jobs],
        "images_per_s": ips, "seconds": times, "best_static": best_static,
        "dvllm_vs_serial": ips["dvllm"] / ips["serial"], "dvllm_vs_best_static": ips["dvllm"] / ips[best_static],
    }
    if args.profile:
        result["profile"] = _profile(args, jobs, rows)
    return result


def static_batches(jobs: list[Job], pipeline: Callable[[list[Job]], None], size: int) -> Callable[[], None]:
    """A static batcher: each group of jobs that agree on what one pipeline call shares, in calls of `size`."""
    def go() -> None:
        groups: dict[tuple, list[Job]] = defaultdict(list)
        for j in jobs:
            groups[j.group].append(j)
        for group in groups.values():
            for i in range(0, len(group), size):
                pipeline(group[i:i + size])
    return go


def _profile(args: argparse.Namespace, jobs: list[Job], rows: int) -> dict:
    params = [SamplingParams(num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height, width=j.width,
                             seed=j.seed, sampler=j.sampler) for j in jobs]
    prompts = [j.prompt for j in jobs]
    make_engine(args, rows, profile_steps=True).generate(prompts, params, use_tqdm=False)  # warm-up
    engine = make_engine(args, rows, profile_steps=True)
    engine.generate(prompts, params, use_tqdm=False)
    return engine.profile()


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _machine(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return f"{device.type}:{name}, {torch.get_num_threads()} threads, torch {torch.__version__}, {dtype}"


def print_report(result: dict) -> None:
    args, ips = result["args"], result["images_per_s"]
    print(f"\nmodel={args['model']} workload={args['workload']} requests={args['num_requests']} "
          f"steps={args['steps']} guidance={args['guidance']} size={args['size']} "
          f"sampler={args['sampler'] or 'model default'}  [{result['machine']}]")
    best = result["best_static"]
    print(f"{'engine':<14}{'images/s':>10}{'vs serial':>11}{'vs best static':>16}")
    for name, value in ips.items():
        print(f"{name:<14}{value:>10.2f}{value / ips['serial']:>10.2f}x{value / ips[best]:>15.2f}x")
    print(f"\ndvllm / serial = {result['dvllm_vs_serial']:.2f}x   "
          f"dvllm / best static ({best}) = {result['dvllm_vs_best_static']:.2f}x")
    if "profile" in result:
        prof = result["profile"]
        print(f"\ndvllm step profile ({prof['steps']} steps):")
        for phase, ms in prof["ms_per_step"].items():
            print(f"  {phase:<15}{ms:>9.2f} ms/step")
        print(f"  share of step time outside the forward: {100 * prof['share_outside_forward']:.1f}% "
              f"(engine overhead, without text encoder and VAE: {100 * prof['share_engine_overhead']:.1f}%)")


def run_and_report(args: argparse.Namespace) -> dict:
    """Runs the comparison args ask for (serial/static/dvllm; with --executor ray in-process vs Ray workers;
    with --cache step caching; with --loras multi-LoRA) and prints its report."""
    if args.executor == "ray":
        from dvllm.benchmarks import data_parallel

        result = data_parallel.run(args)
        data_parallel.print_report(result)
    elif args.cache:
        from dvllm.benchmarks import cached

        result = cached.run(args)
        cached.print_report(result)
    elif args.loras:
        from dvllm.benchmarks import lora

        result = lora.run(args)
        lora.print_report(result)
    else:
        result = run(args)
        print_report(result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = run_and_report(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
