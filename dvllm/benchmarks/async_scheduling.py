"""What async scheduling hides of the driver's per-step work, async_scheduling off vs on.

With `async_scheduling` (`DiffusionEngine(..., async_scheduling=True)`, `--async-scheduling`) the in-process
worker steps on a thread of its own ("dvllm-worker") while the driver schedules the next step and applies the
previous step's update (up to two steps queued): scheduling, the scheduler's update, building the outputs (a
progress output per request per step here) no longer sit between two of the worker's steps.

One run, the two engines interleaved round by round (off, on, then on, off, ...) after a warm-up round each. Each
round: `--requests` small requests (`--steps` steps, `--size`x`--size`, `--guidance` 1.0 by default: no CFG, one
row each), output_kind="progress" (the driver builds every request's output at every step), output_type="np",
submitted at once (or `--per-step` of them before each engine step), on a preset's architecture with random
weights (`--load-format dummy`), `--max-batch-size` rows per forward. The prompts are the same every round (after
the warm-up they are in the prompt cache: the steady state of a busy server); the seeds change every round, and
both engines get the same. The worker's idle time is timed two ways: between consecutive denoiser forwards (the end
of one to the start of the next: the worker's own work besides the forward, its sampler update and the state's
gather and scatter, plus whatever it waits for the driver), and between consecutive steps of the worker
(`Worker.execute`, the end of one to the start of the next): the time it waits for the driver, which is what async
scheduling can hide. Nothing is synchronized for the timing: on a GPU a forward's span is the host's time to issue
it (and whatever it waits for), and a gap the host's time between two, not the GPU's idle time; there the wall time
is the figure that counts (a synchronization per forward would also take away the overlap of the driver's work with
kernels in flight that the engine has without async scheduling).

Reported per engine, medians over rounds: the round's wall time (the first request's submission to the last
image), denoiser forwards per second and request-steps per second, the mean and total gap between forwards, the
longest, the mean forward, the forwards per round, the worker's idle time between its steps (in all, the mean,
median and longest per step); then the ratios on/off of the wall time, of the mean gap and of the worker's idle
time, and the largest difference between the two engines' images of the same request (same prompts, same seeds).
They must be equal within 1e-5 (rows that share forwards with other neighbours in other groupings may move by
~1e-6): the script exits non-zero otherwise, after writing its figures.

What the gain depends on: the driver's time per step against the forward's. The most async scheduling can save is
the driver's share of each step (the worker's own bookkeeping stays), so the wall time falls by at most
driver / (driver + worker's step): much where forwards are short (a small model, small images, a small batch, a
GPU), next to nothing where a forward takes a second. On a machine with few cores the worker's
thread and the driver share them: while the driver works beside a forward, the forward has fewer cores (torch's
intra-op threads and the driver's Python contend), so on 2 CPU cores the overlap can cost as much as it hides.
It depends on the workload too: where a whole batch takes its last step together (equal steps, all submitted at
once), the worker's queue holds the next batch only if requests wait to take the rows the finishing ones leave
(the scheduler gives those rows away while the last step is in flight; their blocks stay until its update); with
`--per-step`, requests finish one at a time and the worker's queue stays full (`worker_idle_longest_s`).

With `--executor ray` both engines run their worker(s) in Ray actors (`--num-workers`, one CPU and one torch
thread each) on one local Ray runtime the script starts for both and stops after (it joins the process's own if
there is one). There each step is a round trip to the actor (the step sent, its output back); async scheduling
hides it by queuing the next step behind the running one, so the worker does not wait for the driver between two
steps. Measured: the wall time per round, request-steps per
second, the ratio on/off of the wall time and the images' largest difference (same tolerance). Not measured: the
gaps between forwards and the worker's idle time (`"worker_timing": "not measured: ..."`, their keys absent and
their ratios null), nor whether the actor runs the decode stage (`decode_stage` null): the script reads (and
wraps) them on the worker object, which with Ray lives in the actor's process, not this one.

    python -m dvllm.benchmarks.async_scheduling --model tiny-sd --size 64 --requests 32 --steps 8
    python -m dvllm.benchmarks.async_scheduling --model tiny-sd --size 32 --requests 32 --steps 8 --executor ray
    python -m dvllm.benchmarks.async_scheduling --model sd15 --size 512 --device cuda    # on a GPU
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dvllm import DiffusionEngine, SamplingParams
from dvllm.benchmarks.loop_stall import gaps, run_off_on, time_forwards

TOLERANCE = 1e-5  # the largest difference allowed between the two engines' images of a request
NOT_MEASURED = "not measured: the worker runs in a Ray actor"  # the forwards' gaps, the worker's idle time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd15", help="A preset, folder or Hub id.")
    parser.add_argument("--load-format", default="dummy", choices=("auto", "dummy"),
                        help="dummy: the architecture with random weights (presets have none).")
    parser.add_argument("--size", type=int, default=64, help="Side of every image, in pixels.")
    parser.add_argument("--requests", type=int, default=32, help="Requests per round.")
    parser.add_argument("--steps", type=int, default=8, help="Steps of every request.")
    parser.add_argument("--guidance", type=float, default=1.0, help="Guidance scale (1.0: no CFG, one row each).")
    parser.add_argument("--max-batch-size", type=int, default=8, help="The engines' rows per forward.")
    parser.add_argument("--per-step", type=int, default=0,
                        help="Requests submitted before each engine step (0: all at once).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds per engine, interleaved.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--executor", default="uniproc", choices=("uniproc", "ray"),
                        help="uniproc: the worker in this process; ray: in Ray actors (one CPU each), on a local "
                             "Ray runtime started for both engines.")
    parser.add_argument("--num-workers", type=int, default=1, help="Ray workers per engine (with --executor ray).")
    parser.add_argument("--output", help="Write the figures as JSON here.")
    return parser


def time_executes(engine: DiffusionEngine) -> list[tuple[float, float]]:
    """(start, end) of each step the in-process worker executes from now on (on its own thread with async
    scheduling), appended to the list returned."""
    executes: list[tuple[float, float]] = []
    worker = engine.executor.worker
    real = worker.execute

    def timed(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = real(*a, **k)
        executes.append((start, time.perf_counter()))
        return out

    worker.execute = timed  # the executor looks it up at each step, on its thread or not
    return executes


@dataclass
class Round:
    wall: float
    images: dict[str, np.ndarray] = field(repr=False)
    # the in-process worker's timing (None with Ray: the worker runs in an actor)
    worker_steps: int | None = None
    worker_gaps: list[float] | None = None  # between the worker's consecutive steps
    forwards: int | None = None
    mean_gap: float | None = None
    total_gap: float | None = None
    longest_gap: float | None = None
    mean_forward: float | None = None


def _engine(args: argparse.Namespace, on: bool) -> DiffusionEngine:
    ray = {"executor": "ray", "num_workers": args.num_workers, "worker_num_cpus": 1} if _ray(args) else {}
    engine = DiffusionEngine(model=args.model, load_format=args.load_format, device=args.device,
                             async_scheduling=on, max_batch_size=args.max_batch_size,
                             max_image_pixels=args.size ** 2, **ray)
    if ray:  # nothing to wrap in this process
        engine.forwards = engine.executes = None  # type: ignore[attr-defined]
    else:
        engine.forwards = time_forwards(engine)  # type: ignore[attr-defined]  # no sync: see the docstring
        engine.executes = time_executes(engine)  # type: ignore[attr-defined]
    return engine


def _ray(args: argparse.Namespace) -> bool:
    return args.executor == "ray"


@contextlib.contextmanager
def _ray_runtime(args: argparse.Namespace) -> Iterator[None]:
    """With --executor ray: one local Ray runtime for both engines (a logical CPU for each of their workers), shut
    down after. Each engine finds it running, joins it and leaves it up (left to the engines, the first would start
    one sized to the machine's cores, the second join it, and the first's shutdown stop it under the second); a
    runtime this process already had is used and left up."""
    if not _ray(args):
        yield
        return
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2 * args.num_workers, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _requests(args: argparse.Namespace, index: int) -> list[tuple[str, str, SamplingParams]]:
    """(request id, prompt, params) of a round: the same prompts every round, seeds of the round's own."""
    common = {"height": args.size, "width": args.size, "guidance_scale": args.guidance,
              "num_inference_steps": args.steps, "output_type": "np", "output_kind": "progress"}
    return [(f"r{index}-{i}", f"a small picture, number {i}", SamplingParams(seed=1000 * index + i, **common))
            for i in range(args.requests)]


def _round(engine: DiffusionEngine, args: argparse.Namespace, index: int) -> Round:
    requests = _requests(args, index)
    # checked before the round (as the async engine does, off the loop), so the round times the loop alone
    processed = [engine.processor.process(request_id, prompt, params) for request_id, prompt, params in requests]
    processed.reverse()
    pending = {request_id for request_id, _, _ in requests}
    images: dict[str, np.ndarray] = {}
    per_step = args.per_step or len(processed)
    timed = engine.forwards is not None
    if timed:
        engine.forwards.clear()
        engine.executes.clear()
    start = time.perf_counter()
    while pending:
        for _ in range(min(per_step, len(processed))):
            engine.add_processed(processed.pop())
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"{out.request_id} failed: {out.error}")
            if out.finished:
                pending.discard(out.request_id)
                images[out.request_id] = out.images[0]
    wall = time.perf_counter() - start
    spans, executes = (list(engine.forwards), list(engine.executes)) if timed else ([], [])
    while engine.has_unfinished_requests():  # the last requests' blocks are freed by the step after their image
        for out in engine.step():
            raise RuntimeError(f"an output after the round's last image: {out.request_id}")
    images = {request_id.split("-", 1)[1]: image for request_id, image in images.items()}
    if not timed:
        return Round(wall=wall, images=images)
    if len(engine.forwards) != len(spans):
        raise RuntimeError("a forward after the round's last image")
    between = gaps(spans)
    return Round(wall=wall, worker_steps=len(executes), worker_gaps=gaps(executes),
                 forwards=len(spans), mean_gap=statistics.fmean(between), total_gap=sum(between),
                 longest_gap=max(between), mean_forward=statistics.fmean(end - begin for begin, end in spans),
                 images=images)


def _summary(rounds: list[Round], args: argparse.Namespace) -> dict[str, Any]:
    if _ray(args):  # the wall time alone: the worker's timing is not measured
        per_round = [{"wall_s": r.wall, "request_steps_per_s": args.requests * args.steps / r.wall} for r in rounds]
        return {**{key: statistics.median(r[key] for r in per_round) for key in per_round[0]}, "rounds": per_round}
    per_round = [{"wall_s": r.wall, "worker_steps": r.worker_steps, "worker_idle_s": sum(r.worker_gaps),
                  "worker_idle_per_step_s": statistics.fmean(r.worker_gaps),
                  "worker_idle_median_s": statistics.median(r.worker_gaps),
                  "worker_idle_longest_s": max(r.worker_gaps), "forwards": r.forwards,
                  "forwards_per_s": r.forwards / r.wall,
                  "request_steps_per_s": args.requests * args.steps / r.wall, "mean_gap_s": r.mean_gap,
                  "total_gap_s": r.total_gap, "longest_gap_s": r.longest_gap, "mean_forward_s": r.mean_forward}
                 for r in rounds]
    return {**{key: statistics.median(r[key] for r in per_round) for key in per_round[0]}, "rounds": per_round}


def _compare(engines: dict[str, DiffusionEngine], args: argparse.Namespace) -> dict[str, Any]:
    for engine in engines.values():  # warm up: kernels, the prompt cache, the worker's thread
        _round(engine, args, 0)
    rounds: dict[str, list[Round]] = {name: [] for name in engines}
    worst_diff = 0.0
    for r in range(1, args.rounds + 1):
        images = {}
        for name in ("off", "on") if r % 2 else ("on", "off"):
            result = _round(engines[name], args, r)
            rounds[name].append(result)
            images[name] = result.images
        if images["on"].keys() != images["off"].keys():
            raise RuntimeError("the two engines finished different requests")
        worst_diff = max(worst_diff, max(float(np.abs(images["on"][k] - images["off"][k]).max())
                                         for k in images["off"]))
    ray = _ray(args)
    result: dict[str, Any] = {
        "model": args.model, "load_format": args.load_format, "size": args.size, "requests": args.requests,
        "steps": args.steps, "guidance": args.guidance, "max_batch_size": args.max_batch_size,
        "per_step": args.per_step, "rounds": args.rounds, "device": args.device,
        **({"executor": "ray", "num_workers": args.num_workers, "worker_num_cpus": 1} if ray else {}),
        # as resolved; unknown here with Ray (the worker, and its decode stage, live in the actor)
        "decode_stage": None if ray else engines["off"].executor.worker.runner.decode_stage is not None,
        **({"worker_timing": NOT_MEASURED} if ray else {}),
        **{name: _summary(rounds[name], args) for name in engines},
        "images_max_abs_diff": worst_diff,
    }
    result["images_equal"] = worst_diff <= TOLERANCE
    result["wall_ratio_on_off"] = result["on"]["wall_s"] / result["off"]["wall_s"]
    if ray:
        result["mean_gap_ratio_on_off"] = result["worker_idle_ratio_on_off"] = None
        return result
    result["mean_gap_ratio_on_off"] = result["on"]["mean_gap_s"] / result["off"]["mean_gap_s"]
    result["worker_idle_ratio_on_off"] = result["on"]["worker_idle_s"] / result["off"]["worker_idle_s"]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the comparison, prints and writes its figures, and returns them; SystemExit(1) when the two engines'
    images of a request differ by more than TOLERANCE (after writing the figures)."""
    args = build_parser().parse_args(argv)
    with _ray_runtime(args):
        result = run_off_on(args, _engine, _compare)
    if not result["images_equal"]:
        print(f"FAIL: the engines' images differ by {result['images_max_abs_diff']:.3g} (> {TOLERANCE})",
              file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
