"""A mixed video workload (Wan): dvllm's step-level batching against the diffusers WanPipeline run serially and in
static batches of equal shapes, in one run, on the same requests and arrival times.

Each request draws its size (two), frame count (9-33), step count and guidance (with and without CFG) from seeded
generators (workloads.mix_workload, plus the frames), at Poisson or gamma arrivals (workloads.arrival_times).
Three engines serve the trace in turn, each alone on the machine, `--rounds` times:
- dvllm: the engine in this process; rows of one size and frame count share each step's forward, whatever their
  step counts and arrivals;
- serial: the WanPipeline built from the same model with the same dummy weights (baselines/runner.py's loader),
  one request at a time, oldest first;
- static: that pipeline called once for requests of one shape (size, frames, steps, guidance) that arrived within
  a window, as the static baseline server batches (baselines/runner.py's Batcher).
Then a second trace: one long clip, and short clips arriving just behind it. A pipeline runs them after the long
clip's whole call; step batching can run their steps between the long clip's.

Reports videos/s, frames/s, latency p50/p95 and the ratios dvllm/serial and dvllm/static (throughput: above 1 is
dvllm faster; latency: below 1 is dvllm sooner).

    python -m dvllm.benchmarks.video_workload --model wan-cpu --num-requests 12 --request-rate 0.2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dvllm.benchmarks.baselines.runner import Batcher, Job, PipelineRunner, load_on_worker
from dvllm.benchmarks.report import json_safe, percentile
from dvllm.benchmarks.throughput import _machine
from dvllm.benchmarks.workloads import arrival_times, check_size, mix_workload, split_list
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.samplers import make_scheduler
from dvllm.sampling_params import SamplingParams

ENGINES = ("serial", "static", "dvllm")


@dataclass(frozen=True)
class VideoRequest:
    prompt: str
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    seed: int
    arrival: float  # seconds from the trace's start

    def params(self) -> SamplingParams:
        return SamplingParams(num_inference_steps=self.steps, guidance_scale=self.guidance, height=self.height,
                              width=self.width, num_frames=self.frames, seed=self.seed, output_type="np")


def _dims(size: str) -> tuple[int, int]:
    width, height = (int(v) for v in check_size(size).split("x"))
    return width, height


def mixed_workload(num: int, *, sizes: list[str], frames: list[int], steps: list[int], guidances: list[float],
                   rate: float, burstiness: float = 1.0, seed: int = 0) -> list[VideoRequest]:
    """The image mix's requests (prompt, size, steps, guidance, seed), each with frames drawn from `frames`."""
    if num < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num}")
    specs = mix_workload(num, sizes=sizes, steps=steps, guidances=guidances, samplers=[None], seed=seed)
    rng = random.Random(f"frames {seed}")  # its own stream: the image mix's draws stay as they are
    arrivals = arrival_times(num, rate, burstiness, seed)
    return [VideoRequest(s.prompt, *_dims(s.size), rng.choice(frames), s.steps, s.guidance, s.seed, at)
            for s, at in zip(specs, arrivals)]


def behind_long_workload(shorts: int, gap_s: float, *, size: str, frames: list[int], steps: list[int],
                         guidance: float, seed: int = 0) -> list[VideoRequest]:
    """One long clip (the most frames and steps) at 0, then `shorts` short ones (the fewest) every `gap_s`."""
    if shorts < 1 or not gap_s >= 0:
        raise ValueError(f"--shorts must be >= 1 and --short-gap-s >= 0, got {shorts} and {gap_s}")
    width, height = _dims(size)
    long = VideoRequest(f"a long clip (run {seed})", width, height, max(frames), max(steps), guidance, seed, 0.0)
    return [long] + [VideoRequest(f"short clip number {i} (run {seed})", width, height, min(frames), min(steps),
                                  guidance, seed + 1 + i, gap_s * (i + 1)) for i in range(shorts)]


class VideoPipelineRunner:
    """baselines/runner.py's PipelineRunner for videos: the Batcher calls run(jobs) on the pipeline's thread."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner

    def resolve(self, request: VideoRequest) -> SamplingParams:
        return self.runner.resolve(request.params())

    def run(self, jobs: list[Job]) -> list[list[np.ndarray]]:
        """One WanPipeline call for jobs of one shape; each job's videos, [frames, H, W, 3] each."""
        p = jobs[0].params
        pipe = self.runner.pipeline
        pipe.scheduler = make_scheduler(self.runner.info.schedule.config, p.sampler)  # schedulers keep state
        if len(jobs) == 1:
            generator: Any = torch.Generator("cpu").manual_seed(p.seed)
        else:  # one per video, as dvllm seeds each request's rows
            generator = [g for job in jobs for g in [torch.Generator("cpu").manual_seed(job.params.seed)] * p.n]
        out = pipe([job.prompt for job in jobs], height=p.height, width=p.width, num_frames=p.num_frames,
                   num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                   num_videos_per_prompt=p.n, generator=generator, output_type="np")
        return [list(out.frames[i * p.n:(i + 1) * p.n]) for i in range(len(jobs))]


def _check_video(videos: list[Any], request: VideoRequest, engine: str) -> None:
    want = (request.frames, request.height, request.width, 3)
    shapes = [tuple(np.shape(v)) for v in videos]
    if shapes != [want]:
        raise RuntimeError(f"{engine}: {request.prompt!r} gave videos of shapes {shapes}, want [{want}]")


async def _trace(requests: list[VideoRequest], serve: Callable[[VideoRequest], Awaitable[None]]) -> dict[str, Any]:
    """Sends each request at its arrival offset; each one's latency (arrival to its video) and the duration."""
    start = time.perf_counter()

    async def one(request: VideoRequest) -> float:
        await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
        sent = time.perf_counter()
        await serve(request)
        return time.perf_counter() - sent

    latencies = await asyncio.gather(*(one(r) for r in requests))
    return {"latencies_s": list(latencies), "duration_s": time.perf_counter() - start}


def dvllm_server(engine: AsyncDiffusionEngine) -> Callable[[VideoRequest], Awaitable[None]]:
    async def serve(request: VideoRequest) -> None:
        final = None
        async for out in engine.generate(request.prompt, request.params()):
            final = out
        if final.error is not None:
            raise RuntimeError(f"dvllm: {request.prompt!r} failed: {final.error}")
        _check_video(final.images, request, "dvllm")
    return serve


def pipeline_server(runner: VideoPipelineRunner, batcher: Batcher, name: str) -> Callable[[VideoRequest],
                                                                                       Awaitable[None]]:
    async def serve(request: VideoRequest) -> None:
        # the frames join the batcher's key: only videos of one length share a call
        job = Job(request.prompt, runner.resolve(request), asyncio.get_running_loop().create_future(),
                  batch_tag=request.frames)
        batcher.submit(job)
        _check_video(await job.future, request, name)
    return serve


def summarize(requests: list[VideoRequest], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure is the median over the rounds; every request's video came (or the run raised)."""
    frames = sum(r.frames for r in requests)

    def median(figure: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(figure(run) for run in runs)

    return {
        "videos": len(requests), "frames": frames,
        "videos_per_s": median(lambda run: len(requests) / run["duration_s"]),
        "frames_per_s": median(lambda run: frames / run["duration_s"]),
        "latency_p50_s": median(lambda run: percentile(run["latencies_s"], 50)),
        "latency_p95_s": median(lambda run: percentile(run["latencies_s"], 95)),
        "duration_s": median(lambda run: run["duration_s"]), "rounds": runs,
    }


def ratios(summaries: dict[str, dict[str, Any]], figures: tuple[str, ...]) -> dict[str, dict[str, float]]:
    return {f"dvllm/{other}": {f: summaries["dvllm"][f] / summaries[other][f] for f in figures}
            for other in ("serial", "static")}


def behind_long_summary(requests: list[VideoRequest], runs: list[dict[str, Any]]) -> dict[str, Any]:
    shorts = [run["latencies_s"][1:] for run in runs]
    return {"long_latency_s": statistics.median(run["latencies_s"][0] for run in runs),
            "short_latency_p50_s": statistics.median(percentile(s, 50) for s in shorts),
            "short_latency_max_s": statistics.median(max(s) for s in shorts), "rounds": runs}


def engine_order(round_: int) -> tuple[str, ...]:
    """Each round starts with the next engine: a shared machine's load drifts, and the last engine in every round
    would run on the quietest machine."""
    shift = round_ % len(ENGINES)
    return ENGINES[shift:] + ENGINES[:shift]


async def _measure(args: argparse.Namespace, mixed: list[VideoRequest],
                   behind: list[VideoRequest]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    runner, worker = load_on_worker(model=args.model, load_format=args.load_format, device=args.device,
                                    dtype=args.dtype)
    pipeline = VideoPipelineRunner(runner)
    for request in mixed + behind:  # what the engine refuses, refused before anything is timed
        pipeline.resolve(request)
    # The memory profile runs the worst step the limits allow: the workload's longest clip, not Wan's 129 frames
    longest = max(r.frames for r in mixed + behind)
    # On a GPU the pipeline's activations need room beside the engine's pool: --gpu-memory-utilization caps it
    engine = AsyncDiffusionEngine(model=args.model, load_format=args.load_format, device=args.device,
                                  dtype=args.dtype, engine_core_process=False, max_num_frames=longest,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  max_running_pixels=args.max_running_pixels)
    engine.start()
    # Both batchers feed the one pipeline thread; their loops end with this event loop (asyncio.run cancels
    # them): Batcher.stop would also shut that thread.
    serial = Batcher(pipeline, worker, max_batch_size=1)
    static = Batcher(pipeline, worker, max_batch_size=args.max_batch_size, window_s=args.batch_window_ms / 1000)
    serial.start()
    static.start()
    servers = {"serial": pipeline_server(pipeline, serial, "serial"),
               "static": pipeline_server(pipeline, static, "static"), "dvllm": dvllm_server(engine)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"mixed": {e: [] for e in ENGINES},
                                                        "behind_long": {e: [] for e in ENGINES}}
    try:
        warm = [VideoRequest("a warm-up", r.width, r.height, r.frames, 1, r.guidance, 0, 0.0) for r in behind[-1:]]
        for name in ("serial", "dvllm"):  # allocators, kernels: the static engine is the serial one's pipeline
            await _trace(warm, servers[name])
        for round_ in range(args.rounds):  # round by round, so the machine's noise hits every engine alike
            order = engine_order(round_)
            for trace, requests in (("mixed", mixed), ("behind_long", behind)):
                for name in order:
                    runs[trace][name].append(await _trace(requests, servers[name]))
                    _progress(trace, name, round_, runs[trace][name][-1])
    finally:
        await engine.shutdown()
    return runs


def _progress(trace: str, engine: str, round_: int, run: dict[str, Any]) -> None:
    """One line per trace as it ends: a run cut short (a GPU lease's time) still leaves its figures in the log."""
    latencies = ", ".join(f"{s:.2f}" for s in run["latencies_s"])
    print(f"[round {round_}] {trace} {engine}: {run['duration_s']:.2f} s; latencies {latencies}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = split_list(args.sizes, str, "--sizes")
    frames, steps = split_list(args.frames, int, "--frames"), split_list(args.steps, int, "--steps")
    guidances = split_list(args.guidance, float, "--guidance")
    if args.rounds < 1 or args.max_batch_size < 1:
        raise ValueError(f"--rounds and --max-batch-size must be >= 1, got {args.rounds} and {args.max_batch_size}")
    mixed = mixed_workload(args.num_requests, sizes=sizes, frames=frames, steps=steps, guidances=guidances,
                           rate=args.request_rate, burstiness=args.burstiness, seed=args.seed)
    behind = behind_long_workload(args.shorts, args.short_gap_s, size=sizes[0], frames=frames, steps=steps,
                                  guidance=max(guidances), seed=args.seed)
    runs = asyncio.run(_measure(args, mixed, behind))
    mixed_summaries = {name: summarize(mixed, runs["mixed"][name]) for name in ENGINES}
    behind_summaries = {name: behind_long_summary(behind, runs["behind_long"][name]) for name in ENGINES}
    return {
        "model": args.model, "machine": _machine(torch.device(args.device), getattr(torch, args.dtype)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
        "engine_order": [list(engine_order(r)) for r in range(args.rounds)],
        "mixed": {"requests": [asdict(r) for r in mixed], **mixed_summaries,
                  "ratios": ratios(mixed_summaries, ("videos_per_s", "frames_per_s", "latency_p50_s",
                                                     "latency_p95_s"))},
        "behind_long": {"requests": [asdict(r) for r in behind], **behind_summaries,
                        "ratios": ratios(behind_summaries, ("short_latency_p50_s", "short_latency_max_s",
                                                            "long_latency_s"))},
    }


def print_report(result: dict[str, Any]) -> None:
    mixed, behind = result["mixed"], result["behind_long"]
    bound = result["args"].get("max_running_pixels")
    print(f"\n{result['model']}: {len(mixed['requests'])} videos  [{result['machine']}]"
          + (f"  dvllm's max_running_pixels {bound:,}" if bound else ""))
    print(f"{'engine':<8}{'videos/s':>10}{'frames/s':>10}{'p50 s':>8}{'p95 s':>8}")
    for name in ENGINES:
        s = mixed[name]
        print(f"{name:<8}{s['videos_per_s']:>10.3f}{s['frames_per_s']:>10.2f}{s['latency_p50_s']:>8.2f}"
              f"{s['latency_p95_s']:>8.2f}")
    long = behind["requests"][0]
    print(f"\nbehind a long clip ({long['frames']} frames, {long['steps']} steps): short clips' latency")
    print(f"{'engine':<8}{'short p50 s':>12}{'short max s':>12}{'long s':>8}")
    for name in ENGINES:
        s = behind[name]
        print(f"{name:<8}{s['short_latency_p50_s']:>12.2f}{s['short_latency_max_s']:>12.2f}{s['long_latency_s']:>8.2f}")
    for trace in (mixed, behind):
        for pair, figures in trace["ratios"].items():
            print(f"{pair:<14}" + "  ".join(f"{f} {v:.2f}x" for f, v in figures.items()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="wan-cpu")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--sizes", default="256x256,320x192", help="WxH sizes to draw from (default: %(default)s)")
    p.add_argument("--frames", default="9,17,25,33", help="frame counts to draw from (default: %(default)s)")
    p.add_argument("--steps", default="4,6,8,10", help="step counts to draw from (default: %(default)s)")
    p.add_argument("--guidance", default="1.0,5.0", help="guidance scales, <= 1: no CFG (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second; inf: all at once (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1.0 Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=8, help="static: videos per pipeline call at most")
    p.add_argument("--batch-window-ms", type=float, default=20.0, help="static: how long a call waits for more")
    p.add_argument("--shorts", type=int, default=3, help="short clips behind the long one")
    p.add_argument("--short-gap-s", type=float, default=0.5, help="seconds between the short clips' arrivals")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds, engines in turn, each round another first (medians reported)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                   help="the engine's share of the GPU; the rest holds the pipeline's activations "
                        "(default: %(default)s)")
    p.add_argument("--max-running-pixels", type=int, default=None,
                   help="dvllm's bound on running pixels (EngineConfig.max_running_pixels; default: none)")
    p.add_argument("--output-json", default=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except ValueError as e:
        parser.exit(2, f"video_workload: error: {e}\n")
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(json_safe(result), f, indent=1)


if __name__ == "__main__":
    main()
