"""Data parallel over Ray workers vs the in-process executor, on the same jobs, in one run.

Three engines run the same requests, interleaved round by round: in-process (one torch
thread), Ray with one worker and Ray with N workers (one CPU and one thread each, or a
GPU each). Reports images/s, N workers vs one, and the time per step that Ray adds to
the in-process executor. Both denoise the same rows; their step counts may differ by a step or two, as when
each request's encoding lands decides the step it joins.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dvllm.benchmarks.throughput import Job, _machine, make_jobs
from dvllm.engine.engine import DiffusionEngine
from dvllm.sampling_params import SamplingParams


def run(args: argparse.Namespace) -> dict:
    import ray

    jobs = make_jobs(args)
    rows = args.max_batch_size or max(16, 2 * len(jobs))
    torch.set_num_threads(1)  # the in-process engine gets what one worker gets
    started = not ray.is_initialized()
    if started:
        # logical CPUs for both Ray engines at once (they take turns, so the cores are not shared)
        num_cpus = None if args.ray_address else args.num_workers + 1
        ray.init(address=args.ray_address, num_cpus=num_cpus, include_dashboard=False, logging_level="warning")
    common = dict(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                  max_batch_size=rows)
    engines = {"in-process": DiffusionEngine(**common)}
    engines["ray x1"] = DiffusionEngine(**common, executor="ray", num_workers=1, ray_address=args.ray_address)
    engines[f"ray x{args.num_workers}"] = DiffusionEngine(**common, executor="ray", num_workers=args.num_workers,
                                                          ray_address=args.ray_address)
    try:
        for engine in engines.values():  # warm-up
            _generate(engine, jobs)
        times: dict[str, list[float]] = {name: [] for name in engines}
        steps: dict[str, list[int]] = {name: [] for name in engines}
        rows: dict[str, list[int]] = {name: [] for name in engines}
        for engine in engines.values():  # the per-step overhead counts timed rounds only
            _reset_core_times(engine)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                before, rows_before = _steps(engine), _rows(engine)
                start = time.perf_counter()
                _generate(engine, jobs)
                times[name].append(time.perf_counter() - start)
                steps[name].append(_steps(engine) - before)
                rows[name].append(_rows(engine) - rows_before)
        # what each executor adds to a step: the driver's round trip minus the worker's own time
        overhead = {name: statistics.mean(w["overhead_ms_per_step"] for w in engine.worker_stats())
                    for name, engine in engines.items()}
        device = engines["in-process"].executor.worker.device
        dtype = engines["in-process"].executor.worker.dtype
    finally:
        for engine in engines.values():
            engine.shutdown()
        if started:
            ray.shutdown()
    ips = {name: len(jobs) / statistics.median(t) for name, t in times.items()}
    n = f"ray x{args.num_workers}"
    one_steps = statistics.median(steps["ray x1"])
    end_to_end = (statistics.median(times["ray x1"]) - statistics.median(times["in-process"])) / one_steps
    return {"machine": _machine(device, dtype), "args": vars(args), "images_per_s": ips, "seconds": times,
            "steps": steps, "rows": rows, "scaling": ips[n] / ips["ray x1"], "overhead_ms_per_step": overhead,
            "end_to_end_difference_ms_per_step": 1000 * end_to_end}


def _generate(engine: DiffusionEngine, jobs: list[Job]) -> None:
    params = [SamplingParams(num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height, width=j.width,
                             seed=j.seed, sampler=j.sampler) for j in jobs]
    outs = engine.generate([j.prompt for j in jobs], params, use_tqdm=False)
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")


def _reset_core_times(engine: DiffusionEngine) -> None:
    for core in engine.coordinator.cores:
        core.steps, core.rows, core.busy_seconds, core.worker_seconds = 0, 0, 0.0, 0.0


def _steps(engine: DiffusionEngine) -> int:
    return sum(w["steps"] for w in engine.worker_stats())


def _rows(engine: DiffusionEngine) -> int:
    """Rows denoised (a request's step, twice with CFG): fixed by the jobs, whatever batches they shared."""
    return sum(core.rows for core in engine.coordinator.cores)


def print_report(result: dict) -> None:
    args = result["args"]
    print(f"\nmodel={args['model']} requests={args['num_requests']} steps={args['steps']} size={args['size']} "
          f"workers={args['num_workers']}  [{result['machine']}, one thread per worker]")
    print(f"{'executor':<14}{'images/s':>10}{'steps':>8}")
    for name, value in result["images_per_s"].items():
        print(f"{name:<14}{value:>10.3f}{statistics.median(result['steps'][name]):>8.0f}")
    over = result["overhead_ms_per_step"]
    print(f"\nray x{args['num_workers']} / ray x1 = {result['scaling']:.2f}x")
    print("time a step spends outside the worker's execute (driver round trip - worker time), ms/step: "
          + ", ".join(f"{name} {value:.2f}" for name, value in over.items()))
    print(f"Ray adds {over['ray x1'] - over['in-process']:.2f} ms/step (one worker); end-to-end difference "
          f"ray x1 - in-process: {result['end_to_end_difference_ms_per_step']:.2f} ms/step")
