"""`dvllm bench run`: one workload replayed, in this process, against several engines of one model.

The contenders, all loaded from the same model with the same weights (presets: dummy weights of one seed):
- `dvllm`: an AsyncDiffusionEngine with step-level batching;
- `request`: the same engine with the request-level policy other servers run by default (batching="request":
  batches of equal shape and parameters, gathered for up to --request-wait-s, run to completion, one LoRA set a
  batch, a cached request alone);
- `serial`: the diffusers pipeline, one request at a time (the baselines' runner, in process): the engine's
  `--lora-modules` loaded with load_lora_weights and each request's set chosen with set_adapters, its cache as
  diffusers' own on the transformer for its call.

The workload is a trace (`--trace FILE`, JSONL as `dvllm bench trace` writes it) or one generated here
(`--generate images|loras|cache|video|uniform|mixed|stall`). Every contender replays the same requests at the same arrival offsets; with
several rounds the contenders' order rotates, so drift in a shared machine's load hits each alike, and each replay
after the first (each round, each rate, each warm-up) sends its texts made new, so no engine's prompt cache holds
them from an earlier replay. A generated trace at several rates (`--rate 0.5,1,2`) is the same requests at each, arriving faster:
goodput against load.

Each request's SLO is `--slo-factor` times its solo latency: what the dvllm engine takes for that request's
shape and parameters with nothing else running, measured once per distinct kind before the replay. Reported per
contender: completed and failed, requests and images per second, latency p50/p95/p99, time to the first step
(dvllm's engines: the first progress output; serial: when its pipeline call begins), SLO attainment and goodput,
and where a request's time went: waiting to be admitted (queue) and admitted to done (service). `--plot-dir`
draws the latency CDFs and goodput against load (dvllm/benchmarks/plot.py). With every request at once
(`--rate inf`) it is offline throughput: the lines under each rate's table give each contender's images/s against
serial's and the best static batch's (`--static-batch-size 1,4,8`: one static contender per size).

Inside the engines: `--forward-gaps` times the step loop between denoiser forwards (probes.py; `--generate stall`
keeps the loop busy while a burst's encodes and decodes land), and an engine built with profile_steps reports
where its step time went. `--deadlines` sends each request its SLO as its deadline. A variant's `threads=N` runs it
with N torch threads (its group members as many), so one worker of N threads and N workers of one get equal
compute.

    dvllm bench run --model tiny-sd --load-format dummy --device cpu --generate uniform --num 16 --rate inf \\
        --size-divisor 32 --clamp-steps 20 --contenders serial,static,dvllm --static-batch-size 4,8,16 --warmup-rounds 1
    dvllm bench run --model tiny-sd --load-format dummy --device cpu --generate stall --num 16 --rate 2 \\
        --size-divisor 16 --forward-gaps --engine-variant inloop:decode_stage=false --contenders dvllm,inloop
    dvllm bench run --model tiny-sd --load-format dummy --device cpu --generate uniform --num 16 --rate inf \\
        --engine-variant one:threads=1 --engine-variant ray2:executor=ray,num_workers=2,worker_num_cpus=1 \\
        --contenders one,ray2

    dvllm bench run --model tiny-sd --load-format dummy --device cpu --generate images --num 40 --rate 1,2,4 \\
        --size-divisor 16 --output-json run.json --plot-dir figs
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dvllm.benchmarks import traces
from dvllm.benchmarks.control_inputs import control_image
from dvllm.benchmarks.probes import ForwardGaps, torch_threads
from dvllm.benchmarks.report import Outcome, format_results, json_safe, run_summary
from dvllm.benchmarks.workloads import SERVER_DEFAULT, RequestSpec, trace_workload

CONTENDERS = ("dvllm", "request", "serial", "static")
PIPELINES = ("serial", "static")
# The engine's counters each replay reports (their change): deadlines met at the finish, step-cache rows
ENGINE_COUNTS = ("deadlines_met", "deadlines_missed", "cache_skipped_rows", "cache_computed_rows")
# The engine's request limits, which the serial pipeline's checks take too: both refuse the same requests
LIMITS = ("max_image_pixels", "max_inference_steps", "max_images_per_prompt", "max_loras", "max_lora_rank")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dvllm.config_flags import add_engine_args

    run = p.add_argument_group("workload")
    run.add_argument("--trace", help="A JSONL trace to replay (dvllm bench trace writes them).")
    run.add_argument("--generate", choices=traces.KINDS, help="Or generate one: images, loras, cache or video.")
    run.add_argument("--num", type=int, default=40, help="Requests of a generated trace (default: 40).")
    run.add_argument("--rate", default="1", help="Its Poisson rate, requests/s; a comma list sweeps them, the same "
                     "requests at each (default: 1).")
    run.add_argument("--size-divisor", type=int, default=8, help="Its sides divided by this (default: 8).")
    run.add_argument("--trace-seed", type=int, default=0)
    traces.add_clamps(run)
    traces.add_control_args(run)
    run.add_argument("--contenders", default="dvllm,request,serial",
                     help=f"Comma list of {', '.join(CONTENDERS)} and --engine-variant labels (default: the first "
                          "three).")
    run.add_argument("--static-batch-size", default="8", help="The static contender's batch (default: 8); a comma "
                     "list runs one static contender per size, named staticB.")
    run.add_argument("--static-window-s", type=float, default=0.05,
                     help="How long the static contender gathers a batch (default: 0.05).")
    run.add_argument("--random-loras", type=int, default=0, metavar="RANK",
                     help="Random adapters of this rank for the LoRA names the trace uses (a generated loras "
                          "trace: lora00..lora31), written to a temporary folder and served as --lora-modules: "
                          "for presets with dummy weights. 0: off (the default).")
    run.add_argument("--random-controlnets", action="store_true",
                     help="Random controlnets of the model's UNet for the control names the trace uses (a generated "
                          "trace with --controls: control0..), served as --controlnet: for presets with dummy "
                          "weights.")
    run.add_argument("--request-wait-s", type=float, default=0.05,
                     help="The request contender's batch window (request_batch_wait_s; default: 0.05).")
    run.add_argument("--engine-variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                     help="One more contender: the dvllm engine with these engine options changed (values as JSON "
                          "where they parse, else strings), e.g. oldest:shape_order=oldest or "
                          "nostage:decode_stage=false. Repeatable; name its label in --contenders.")
    run.add_argument("--rounds", type=int, default=1, help="Replays per contender, the order rotating (default: 1).")
    run.add_argument("--warmup-rounds", type=int, default=0,
                     help="Untimed replays per contender first, at the first rate (allocators, kernels, compiles).")
    run.add_argument("--forward-gaps", action="store_true",
                     help="Time the engines' step loops between denoiser forwards (in-process workers).")
    run.add_argument("--deadlines", action="store_true",
                     help="Each request asks the engines to finish by its SLO (deadline_s; the pipelines ignore it); "
                          "each engine's replay reports the deadlines it met and missed (engine_counts).")
    run.add_argument("--slo-factor", type=float, default=3.0,
                     help="A request meets its SLO within this many times its solo latency (default: 3).")
    run.add_argument("--output-json", help="Also write the results here.")
    run.add_argument("--plot-dir", help="Draw latency_cdf.png and goodput_vs_load.png here (needs matplotlib).")
    add_engine_args(p)


def params_of(spec: RequestSpec) -> Any:
    from dvllm.sampling_params import USE_DEFAULT, SamplingParams

    width, height = (int(v) for v in spec.size.split("x"))
    return SamplingParams(num_inference_steps=spec.steps, guidance_scale=spec.guidance, height=height, width=width,
                          seed=spec.seed, sampler=spec.sampler, n=spec.n, negative_prompt=spec.negative_prompt,
                          num_frames=spec.frames,
                          loras=spec.loras, cache=USE_DEFAULT if spec.cache == SERVER_DEFAULT else spec.cache,
                          priority=spec.priority or 0, deadline_s=spec.deadline, output_type="np",
                          controls=spec.control_list(control_image) if spec.controls else None)


class EngineContender:
    """An AsyncDiffusionEngine; runs on the harness's event loop."""

    def __init__(self, name: str, engine: Any) -> None:
        self.name, self.engine = name, engine

    async def run(self, spec: RequestSpec, request_id: str) -> Outcome:
        start, first = time.perf_counter(), None
        try:
            final = None
            async for out in self.engine.generate(spec.prompt, params_of(spec), request_id=request_id):
                if first is None and not out.finished:
                    first = time.perf_counter() - start
                final = out
            if final is None or final.error is not None:
                return Outcome(None, first, final.error if final is not None else "no output")
            latency, m = time.perf_counter() - start, final.metrics
            service = None if m.first_scheduled_time is None or m.finished_time is None \
                else m.finished_time - m.first_scheduled_time
            return Outcome(latency, first if first is not None else latency, None, m.queue_time, service)
        except Exception as e:  # noqa: BLE001 - a refused request is a failed record, not a failed run
            return Outcome(None, first, f"{type(e).__name__}: {e}")

    def counts(self) -> dict[str, int]:
        """The engine's own counters of what a replay may exercise, so far."""
        stats = self.engine.stats()
        return {name: stats.get(name, 0) for name in ENGINE_COUNTS}

    async def close(self) -> None:
        await self.engine.shutdown(5)


class PipelineContender:
    """The diffusers pipeline (dvllm.benchmarks.baselines, without the HTTP server): `serial`, one request at a
    time; `static`, requests of one key (size, frames, steps, guidance, sampler, n, LoRA set, cache) that arrive
    within a window called together, up to a batch size."""

    def __init__(self, name: str, runner: Any, worker: Any, max_batch_size: int = 1, window_s: float = 0.0) -> None:
        from dvllm.benchmarks.baselines.runner import Batcher

        self.name, self.runner = name, runner
        self.batcher = Batcher(runner, worker, max_batch_size=max_batch_size, window_s=window_s)
        self._started = False

    async def run(self, spec: RequestSpec, request_id: str) -> Outcome:
        from dvllm.benchmarks.baselines.runner import Job

        if not self._started:
            self.batcher.start()
            self._started = True
        start = time.perf_counter()
        try:
            job = Job(spec.prompt, self.runner.resolve(params_of(spec)), asyncio.get_running_loop().create_future())
            job.arrival = time.monotonic()
            self.batcher.submit(job)
            await job.future
        except Exception as e:  # noqa: BLE001
            return Outcome(None, None, f"{type(e).__name__}: {e}")
        latency = time.perf_counter() - start
        first = job.started - job.arrival if job.started is not None else None
        return Outcome(latency, first, None, first, None if first is None else latency - first)

    def counts(self) -> None:  # the pipeline keeps none
        return None

    async def close(self) -> None:
        await self.batcher.stop()


def solo_key(spec: RequestSpec) -> tuple:
    """Requests of one kind take one solo latency: what sets a request's cost alone."""
    return (spec.size, spec.frames, spec.steps, spec.guidance > 1.0, spec.n, json.dumps(spec.cache, sort_keys=True),
            tuple(sorted((spec.loras or {}).items())), tuple(c["name"] for c in spec.controls or ()))


async def solo_latencies(contender: EngineContender, specs: list[RequestSpec]) -> dict[tuple, float]:
    """Each kind's latency alone on the engine (once, nothing else running)."""
    solos: dict[tuple, float] = {}
    for i, spec in enumerate(specs):
        key = solo_key(spec)
        if key not in solos:
            # another prompt, so that the replay finds no prompt of the trace already encoded on this engine
            outcome = await contender.run(replace(spec, prompt=f"solo: {spec.prompt}", priority=None, deadline=None),
                                          f"solo-{i}")
            if outcome.latency is None:
                raise ValueError(f"request {i} ({spec.size}, {spec.steps} steps) fails alone on the engine: "
                                 f"{outcome.error}")
            solos[key] = outcome.latency
    return solos


def fresh(spec: RequestSpec, round_index: int) -> RequestSpec:
    """The request as round 0 sends it; another round's (a warm-up's: negative) with its texts made new, so that no
    engine finds them encoded by an earlier replay (its prompt cache), as no pipeline does: new traffic."""
    if round_index == 0:
        return spec
    tag = f" (replay {round_index})"
    return replace(spec, prompt=spec.prompt + tag,
                   negative_prompt=None if spec.negative_prompt is None else spec.negative_prompt + tag)


async def replay(contender: Any, specs: list[RequestSpec], round_index: int) -> tuple[list[Outcome], float]:
    """Sends every request at its arrival offset; the outcomes in the trace's order and the run's duration."""
    specs = [fresh(spec, round_index) for spec in specs]
    start = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> Outcome:
        await asyncio.sleep(max(0.0, start + (spec.arrival or 0.0) - time.perf_counter()))
        return await contender.run(spec, f"r{round_index}-{i}")

    outcomes = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    return list(outcomes), time.perf_counter() - start


def random_loras(kwargs: dict[str, Any], names: list[str], rank: int, root: str, controls: list[str] = ()
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """name -> folder of a random adapter (lora_adapters.py) for each name, and of a random controlnet
    (control_inputs.py) for each of `controls`, made on the model as the engine loads it (then let go)."""
    import gc

    from dvllm.benchmarks.control_inputs import random_controlnets
    from dvllm.benchmarks.lora_adapters import make_adapter
    from dvllm.models.loader import load_adapter
    from dvllm.executor.worker import resolve_device

    adapter = load_adapter(kwargs["model"], kwargs["load_format"], resolve_device(kwargs["device"]),
                           kwargs["dtype"], seed=kwargs["dummy_weight_seed"])
    paths = {name: make_adapter(adapter.pipeline, str(Path(root) / name), seed=i, rank=rank)
             for i, name in enumerate(names)}
    nets = random_controlnets(adapter.pipeline, list(controls), root) if controls else {}
    del adapter
    gc.collect()
    return paths, nets


def rates_of(text: str) -> list[float]:
    try:
        rates = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rate: positive requests/s (inf: all at once), a comma list without repeats; got {text!r}")
    return rates


def load_workloads(args: argparse.Namespace) -> list[tuple[float | None, list[RequestSpec]]]:
    """(rate, requests) per rate: a trace file once, at its own arrivals (rate None)."""
    if (args.trace is None) == (args.generate is None):
        raise ValueError("give --trace FILE or --generate KIND (one of them)")
    if args.trace is not None:
        if args.rate != "1" or args.clamp_steps is not None or args.clamp_frames is not None:
            raise ValueError("--rate and --clamp-* are for --generate: a trace file's requests are as it says")
        return [(None, trace_workload(args.trace, size="512x512", steps=20, guidance=7.5, sampler=None))]
    workloads = []
    for rate in rates_of(args.rate):
        lines = traces.generate(args.generate, args.num, rate, seed=args.trace_seed, size_divisor=args.size_divisor,
                                max_steps=args.clamp_steps, max_frames=args.clamp_frames,
                                control_share=args.controls, control_pool=args.control_pool)
        with tempfile.TemporaryDirectory() as folder:  # read back as a trace file is, checked alike
            path = Path(folder) / "trace.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            workloads.append((rate, trace_workload(str(path), size="512x512", steps=20, guidance=7.5, sampler=None)))
    return workloads


def variants_of(texts: list[str]) -> dict[str, dict[str, Any]]:
    """--engine-variant LABEL:KEY=VALUE,... -> label -> engine options (checked with the engine's, when it is built)."""
    variants: dict[str, dict[str, Any]] = {}
    for text in texts:
        label, _, body = text.partition(":")
        pairs = [item.partition("=") for item in body.split(",") if item.strip()]
        if not label.strip() or label in CONTENDERS or label in variants or not pairs or any(not k or not eq
                                                                                        for k, eq, _ in pairs):
            raise ValueError(f"--engine-variant: LABEL:KEY=VALUE[,KEY=VALUE], a new label (not {list(CONTENDERS)} nor "
                             f"one given before), got {text!r}")
        options: dict[str, Any] = {}
        for key, _, value in pairs:
            try:
                options[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                options[key.strip()] = value.strip()
        threads = options.get("threads")
        if "threads" in options and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"--engine-variant {label}: threads must be a positive integer, got {threads!r}")
        variants[label.strip()] = options
    return variants


def check_contenders(names: list[str], specs: list[RequestSpec], variants: dict[str, dict[str, Any]] | None = None
                     ) -> None:
    known = [*CONTENDERS, *(variants or {})]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--contenders: a comma list of {known} without repeats, got {names}")
    if all(name in PIPELINES for name in names):
        raise ValueError("--contenders must include an engine: solo latencies are measured on one")
    if any(s.controls for s in specs) and any(name in PIPELINES for name in names):
        raise ValueError("--contenders: the pipeline contenders (serial, static) take no controls yet; a trace with "
                         "controls replays on the engines")


def static_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--static-batch-size: positive batch sizes, a comma list without repeats; got {text!r}")
    return sizes


def expand_static(names: list[str], sizes: list[int]) -> dict[str, int]:
    """contender name -> its static batch size (pipelines only: serial's is 1); several sizes name staticB each."""
    batches: dict[str, int] = {}
    for name in names:
        if name == "static" and len(sizes) > 1:
            batches.update({f"static{b}": b for b in sizes})
        elif name in PIPELINES:
            batches[name] = sizes[0] if name == "static" else 1
    return batches


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.config_flags import engine_kwargs

    if args.plot_dir:
        from dvllm.benchmarks.plot import pyplot

        pyplot()  # before the run, not after it: matplotlib missing is said at once
    workloads = load_workloads(args)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    variants = variants_of(args.engine_variant)
    check_contenders(names, workloads[0][1], variants)
    batches = expand_static(names, static_sizes(args.static_batch_size))
    names = [n for name in names for n in ([b for b in batches if b.startswith("static")] if name == "static"
                                           else [name])]
    if args.rounds < 1 or args.warmup_rounds < 0 or not args.slo_factor > 0:
        raise ValueError("--rounds must be at least 1, --warmup-rounds at least 0 and --slo-factor positive")
    kwargs = engine_kwargs(args)
    folder = tempfile.TemporaryDirectory(prefix="dvllm-bench-loras-")
    if args.random_loras or args.random_controlnets:
        used = sorted({name for _, specs in workloads for s in specs for name in (s.loras or {})})
        controls = sorted({c["name"] for _, specs in workloads for s in specs for c in s.controls or ()})
        if (args.random_loras and not used) or (args.random_controlnets and not controls):
            raise ValueError("--random-loras, --random-controlnets: the trace names no LoRA or no control (generate "
                             "a loras trace, or one with --controls; or give --lora-modules, --controlnet)")
        loras, nets = random_loras(kwargs, used if args.random_loras else [], args.random_loras, folder.name,
                                   controls if args.random_controlnets else [])
        kwargs["lora_modules"] = {**(kwargs.get("lora_modules") or {}), **loras} or kwargs.get("lora_modules")
        kwargs["controlnets"] = {**(kwargs.get("controlnets") or {}), **nets} or kwargs.get("controlnets")
    contenders: dict[str, Any] = {}
    gaps: dict[str, ForwardGaps] = {}  # the engines' step-loop probes, where asked
    threads: dict[str, int | None] = {}  # a variant's torch threads
    runs: list[dict[str, Any]] = []
    try:
        for name in names:
            if name in batches:
                from dvllm.benchmarks.baselines.runner import load_on_worker

                runner, worker = load_on_worker(model=kwargs["model"], load_format=kwargs["load_format"],
                                                device=kwargs["device"], dtype=kwargs["dtype"],
                                                dummy_weight_seed=kwargs["dummy_weight_seed"],
                                                lora_modules=kwargs.get("lora_modules"),
                                                limits={k: kwargs[k] for k in LIMITS if k in kwargs})
                contenders[name] = PipelineContender(name, runner, worker, batches[name],
                                                     args.static_window_s if batches[name] > 1 else 0.0)
                continue
            options = dict(variants.get(name, {"batching": "step"} if name == "dvllm" else
                                        {"batching": "request", "request_batch_wait_s": args.request_wait_s}))
            threads[name] = options.pop("threads", None)
            with torch_threads(threads[name]):
                engine = AsyncDiffusionEngine(**{**kwargs, "batching": "step", **options})
                engine.start()
            contenders[name] = EngineContender(name, engine)
            if args.forward_gaps and (probe := ForwardGaps.attach(engine)) is not None:
                gaps[name] = probe
        reference = contenders.get("dvllm") or next(c for c in contenders.values() if c.name not in batches)
        with torch_threads(threads.get(reference.name)):
            solos = await solo_latencies(reference, [s for _, specs in workloads for s in specs])
        for r in range(args.warmup_rounds):
            for name in names:
                with torch_threads(threads.get(name)):
                    await replay(contenders[name], workloads[0][1], -1 - r)
        for k, (rate, specs) in enumerate(workloads):
            slos = [args.slo_factor * solos[solo_key(s)] for s in specs]
            if args.deadlines:
                specs = [replace(s, deadline=slo) for s, slo in zip(specs, slos)]
            results: dict[str, Any] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    if name in gaps:
                        gaps[name].take()  # what ran before this replay is not its
                    before = contenders[name].counts()
                    with torch_threads(threads.get(name)):
                        # each replay its own index (its texts new but in the very first), over rates too
                        outcomes, duration = await replay(contenders[name], specs, k * args.rounds + r)
                    summary = run_summary(specs, outcomes, slos, duration)
                    if before is not None:  # what the engine counted in this replay
                        summary["engine_counts"] = {k: v - before[k] for k, v in contenders[name].counts().items()}
                    if name in gaps:
                        summary.update(gaps[name].take())
                    results[name].append(summary)
            runs.append({"rate": rate, "contenders": results})
        profiles = {name: c.engine.engine.profile() for name, c in contenders.items()
                    if name not in batches and getattr(getattr(c.engine, "engine", None), "config", None) is not None
                    and c.engine.engine.config.profile_steps}
    finally:
        for contender in contenders.values():
            await contender.close()
        folder.cleanup()
    return {"model": args.model, "requests": len(workloads[0][1]), "slo_factor": args.slo_factor,
            "rounds": args.rounds, "solo_kinds": len(solos), "runs": runs, "profiles": profiles}


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run_async(args))
    print(format_results(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(json_safe(result), indent=2) + "\n")
    if args.plot_dir:
        from dvllm.benchmarks.plot import plot_run

        for path in plot_run(result, args.plot_dir):
            print(path)
    return 0
