"""Step caching, measured in one run (`benchmark_throughput.py --cache ...`):

1. Step cost against the share of rows that compute: a batch of requests whose first_block thresholds
   force the decision (0: every step computes; 1e9: every step after the first skips), so that a fixed
   share of the rows skips; the median steady-state step (no prompt encoding, no decode) against the
   batch where every row computes.
2. Throughput on the workload: dvllm without cache, dvllm with the cache, and the diffusers pipeline
   with the same cache (`transformer.enable_cache`) serially and in the best static batch, on the same
   requests, interleaved round by round. Plus the share of rows that skipped.

On random weights a first_block decision means nothing about quality; the step-cost figures do not
depend on it, and taylorseer's decisions depend on the step only. The built-in tiny-shapes-dit is
trained (`--model tiny-shapes-dit --prompts shapes`): there the decisions follow real dynamics.

SD3's transformer has no enable_cache; its baseline applies diffusers' hooks directly, inside the
cache context its pipeline never opens. diffusers' first block cache fails on SD3 (its last joint
block returns no text stream for the tail hook to subtract), so for first_block the SD3 baseline is
the uncached pipeline, and the report says so.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import diffusers
import torch

from dvllm.benchmarks.baselines.pipeline_options import diffusers_cache, diffusers_cache_unsupported
from dvllm.benchmarks.throughput import Job, _machine, _timed, make_engine, make_jobs, static_batches
from dvllm.sampling_params import SamplingParams
from dvllm.step_cache import CacheConfig, parse_cache_flag

ALWAYS_COMPUTE, ALWAYS_SKIP = 0.0, 1e9  # first_block thresholds that decide every step the same way


def step_cost(args: argparse.Namespace, steps: int = 8) -> dict[str, float]:
    """Median steady-state step time with k of `rows` rows skipping, relative to none skipping; the shares
    take turns round by round, so that machine noise hits each alike."""
    width, height = (int(v) for v in args.size.lower().split("x"))
    rows, rounds = args.cost_rows, args.cost_rounds
    engine = make_engine(args, 2 * rows)  # room for CFG's unconditional rows (SD3)
    shares = (0, rows // 4, rows // 2, 3 * rows // 4, rows)
    times: dict[int, list[float]] = {k: [] for k in shares}
    for round_ in range(rounds + 1):  # the first round warms up
        for skipping in shares:
            for i in range(rows):
                threshold = ALWAYS_SKIP if i < skipping else ALWAYS_COMPUTE
                engine.add_request(f"cost-{skipping}-{round_}-{i}", "a photo", SamplingParams(
                    num_inference_steps=steps, height=height, width=width, seed=i, output_type="latent",
                    cache={"method": "first_block", "threshold": threshold}))
            for step in range(steps):
                start = time.perf_counter()
                engine.step()
                if round_ and 1 <= step < steps - 1:  # after the first (computing) step, before the decode
                    times[skipping].append(time.perf_counter() - start)
            if engine.has_unfinished_requests():
                raise RuntimeError("max_batch_size must hold all the step-cost requests in one forward")
    full = statistics.median(times[0])
    result = {f"{rows - k}/{rows} rows compute": statistics.median(times[k]) / full for k in shares}
    return result | {"full_step_ms": 1000 * full}


def run(args: argparse.Namespace) -> dict:
    diffusers.utils.logging.set_verbosity_error()  # Qwen-Image warns on every call without a negative prompt
    config: CacheConfig = parse_cache_flag(args.cache)
    jobs = make_jobs(args)
    rows = args.max_batch_size or max(16, 2 * len(jobs))
    engine = make_engine(args, rows)
    adapter = engine.executor.worker.runner.adapter
    pipe, device = adapter.pipeline, adapter.device
    unsupported = diffusers_cache_unsupported(pipe.transformer, config)
    guidance_name = "true_cfg_scale" if type(pipe).__name__ == "QwenImagePipeline" else "guidance_scale"
    extra: dict[str, Any] = {}
    if engine.model_info.text.max_sequence_length is not None:  # a model's own text length (tiny-shapes-dit: 1)
        extra["max_sequence_length"] = engine.model_info.text.max_sequence_length
    baseline = "pipeline" if unsupported else "pipeline+cache"

    def pipeline(batch: list[Job]) -> None:
        # diffusers' hooks go on for the baseline only (dvllm's own hooks pass through meanwhile), with state
        # reset for every call, as for a fresh pipeline
        with contextlib.nullcontext() if unsupported else diffusers_cache(pipe.transformer, config):
            j = batch[0]
            pipe([b.prompt for b in batch], num_inference_steps=j.steps, height=j.height, width=j.width,
                 generator=[torch.Generator("cpu").manual_seed(b.seed) for b in batch], output_type="pil",
                 **(extra | {guidance_name: j.guidance}))

    def dvllm(cache: CacheConfig | None) -> Callable[[], None]:
        def go() -> None:
            params = [SamplingParams(num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height,
                                     width=j.width, seed=j.seed, cache=cache) for j in jobs]
            outs = engine.generate([j.prompt for j in jobs], params, use_tqdm=False)
            failed = [o.error for o in outs if o.error]
            if failed:
                raise RuntimeError(f"{len(failed)} dvllm requests failed: {failed[:3]}")
        return go

    sizes = [b for b in (int(x) for x in args.static_batch_sizes.split(",")) if 1 < b <= len(jobs)]
    contenders = {f"{baseline} serial": lambda: [pipeline([j]) for j in jobs],
                  **{f"{baseline} static(b={b})": static_batches(jobs, pipeline, b) for b in sizes},
                  "dvllm": dvllm(None), "dvllm+cache": dvllm(config)}
    for fn in contenders.values():  # warm-up round
        fn()
    before = engine.stats()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(_timed(fn, device))
    after = engine.stats()
    skipped = after["cache_skipped_rows"] - before["cache_skipped_rows"]
    computed = after["cache_computed_rows"] - before["cache_computed_rows"]
    ips = {name: len(jobs) / statistics.median(t) for name, t in times.items()}
    statics = [n for n in ips if "static" in n]
    best_static = max(statics, key=ips.get) if statics else f"{baseline} serial"
    return {
        "machine": _machine(device, adapter.dtype), "args": vars(args), "cache": config.as_dict(),
        "images_per_s": ips, "best_static": best_static, "skipped_row_fraction": skipped / max(1, skipped + computed),
        "baseline": baseline, "baseline_note": unsupported,
        "dvllm_cache_vs_serial_cache": ips["dvllm+cache"] / ips[f"{baseline} serial"],
        "dvllm_cache_vs_static_cache": ips["dvllm+cache"] / ips[best_static],
        "dvllm_cache_vs_dvllm": ips["dvllm+cache"] / ips["dvllm"],
        "step_cost": step_cost(args),
    }


def print_report(result: dict) -> None:
    args, ips = result["args"], result["images_per_s"]
    print(f"\nmodel={args['model']} workload={args['workload']} requests={args['num_requests']} steps={args['steps']} "
          f"size={args['size']} cache={result['cache']}  [{result['machine']}]")
    baseline = result.get("baseline", "pipeline+cache")
    if result.get("baseline_note"):
        print(f"the diffusers baseline runs without the cache: {result['baseline_note']}")
    print(f"{'engine':<30}{'images/s':>10}{f'vs {baseline} serial':>26}")
    serial = ips[f"{baseline} serial"]
    for name, value in ips.items():
        print(f"{name:<30}{value:>10.2f}{value / serial:>25.2f}x")
    print(f"\nrows skipped by dvllm+cache: {100 * result['skipped_row_fraction']:.0f}%   "
          f"dvllm+cache / dvllm = {result['dvllm_cache_vs_dvllm']:.2f}x   "
          f"dvllm+cache / best static+cache ({result['best_static']}) = {result['dvllm_cache_vs_static_cache']:.2f}x")
    cost = dict(result["step_cost"])
    print(f"\nstep time against the rows that compute (first_block, batch of {args['cost_rows']}; full step "
          f"{cost.pop('full_step_ms'):.1f} ms):")
    for name, ratio in cost.items():
        print(f"  {name:<22}{ratio:>6.2f}x a full step")

