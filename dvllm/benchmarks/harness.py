"""`dvllm bench run`: one workload replayed, in this process, against several engines of one model.

The contenders, all loaded from the same model with the same weights (presets: dummy weights of one seed):
- `dvllm`: an AsyncDiffusionEngine with step-level batching;
- `request`: the same engine with the request-level policy other servers run by default (batching="request":
  batches of equal shape and parameters run to completion, one LoRA set a batch, a cached request alone);
- `serial`: the diffusers pipeline, one request at a time (the baselines' runner, in process).

The workload is a trace (`--trace FILE`, JSONL as `dvllm bench trace` writes it) or one generated here
(`--generate images|loras|cache`). Every contender replays the same requests at the same arrival offsets; with
several rounds the contenders' order rotates, so drift in a shared machine's load hits each alike.

Each request's SLO is `--slo-factor` times its solo latency: what the dvllm engine takes for that request's
shape and parameters with nothing else running, measured once per distinct kind before the replay. Reported per
contender: completed and failed, requests and images per second, latency p50/p95/p99, time to the first step
(dvllm's engines: the first progress output; serial: when its pipeline call begins), SLO attainment and goodput.

    dvllm bench run --model tiny-sd --load-format dummy --device cpu --generate images --num 40 --rate 2 \\
        --size-divisor 16 --output-json run.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dvllm.benchmarks import traces
from dvllm.benchmarks.report import RequestRecord, json_safe, percentile, summarize
from dvllm.benchmarks.workloads import SERVER_DEFAULT, RequestSpec, trace_workload

CONTENDERS = ("dvllm", "request", "serial")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dvllm.entrypoints.cli_args import add_engine_args

    run = p.add_argument_group("workload")
    run.add_argument("--trace", help="A JSONL trace to replay (dvllm bench trace writes them).")
    run.add_argument("--generate", choices=traces.KINDS, help="Or generate one: images, loras or cache.")
    run.add_argument("--num", type=int, default=40, help="Requests of a generated trace (default: 40).")
    run.add_argument("--rate", type=float, default=1.0, help="Its Poisson rate, requests/s (default: 1).")
    run.add_argument("--size-divisor", type=int, default=8, help="Its sides divided by this (default: 8).")
    run.add_argument("--trace-seed", type=int, default=0)
    run.add_argument("--contenders", default=",".join(CONTENDERS),
                     help=f"Comma list of {', '.join(CONTENDERS)} (default: all three).")
    run.add_argument("--rounds", type=int, default=1, help="Replays per contender, the order rotating (default: 1).")
    run.add_argument("--slo-factor", type=float, default=3.0,
                     help="A request meets its SLO within this many times its solo latency (default: 3).")
    run.add_argument("--output-json", help="Also write the results here.")
    add_engine_args(p)


@dataclass
class Outcome:
    latency: float | None  # send to final output, seconds; None if it failed
    first_step: float | None  # send to its first step (serial: to its pipeline call), seconds
    error: str | None


def params_of(spec: RequestSpec) -> Any:
    from dvllm.sampling_params import USE_DEFAULT, SamplingParams

    width, height = (int(v) for v in spec.size.split("x"))
    return SamplingParams(num_inference_steps=spec.steps, guidance_scale=spec.guidance, height=height, width=width,
                          seed=spec.seed, sampler=spec.sampler, n=spec.n, negative_prompt=spec.negative_prompt,
                          loras=spec.loras, cache=USE_DEFAULT if spec.cache == SERVER_DEFAULT else spec.cache,
                          priority=spec.priority or 0, deadline_s=spec.deadline, output_type="np")


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
            return Outcome(time.perf_counter() - start, first if first is not None else time.perf_counter() - start,
                           None)
        except Exception as e:  # noqa: BLE001 - a refused request is a failed record, not a failed run
            return Outcome(None, first, f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        await self.engine.shutdown(5)


class SerialContender:
    """The diffusers pipeline, one request at a time (dvllm.benchmarks.baselines, without the HTTP server)."""

    def __init__(self, runner: Any, worker: Any) -> None:
        from dvllm.benchmarks.baselines.runner import Batcher

        self.name, self.runner = "serial", runner
        self.batcher = Batcher(runner, worker, max_batch_size=1)
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
        first = job.started - job.arrival if job.started is not None else None
        return Outcome(time.perf_counter() - start, first, None)

    async def close(self) -> None:
        await self.batcher.stop()


def solo_key(spec: RequestSpec) -> tuple:
    """Requests of one kind take one solo latency: what sets a request's cost alone."""
    return (spec.size, spec.steps, spec.guidance > 1.0, spec.n, json.dumps(spec.cache, sort_keys=True),
            tuple(sorted((spec.loras or {}).items())))


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


async def replay(contender: Any, specs: list[RequestSpec], round_index: int) -> tuple[list[Outcome], float]:
    """Sends every request at its arrival offset; the outcomes in the trace's order and the run's duration."""
    start = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> Outcome:
        await asyncio.sleep(max(0.0, start + (spec.arrival or 0.0) - time.perf_counter()))
        return await contender.run(spec, f"r{round_index}-{i}")

    outcomes = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    return list(outcomes), time.perf_counter() - start


def record(i: int, spec: RequestSpec, outcome: Outcome, slo: float) -> RequestRecord:
    return RequestRecord(index=i, arrival=spec.arrival or 0.0, sent=spec.arrival or 0.0, latency=outcome.latency,
                         ok=outcome.error is None, status=None, error=outcome.error, steps=spec.steps, n=spec.n,
                         size=spec.size, guidance=spec.guidance, sampler=spec.sampler, slo=slo)


def load_specs(args: argparse.Namespace) -> list[RequestSpec]:
    if (args.trace is None) == (args.generate is None):
        raise ValueError("give --trace FILE or --generate KIND (one of them)")
    if args.trace is not None:
        return trace_workload(args.trace, size="512x512", steps=20, guidance=7.5, sampler=None)
    lines = traces.generate(args.generate, args.num, args.rate, seed=args.trace_seed, size_divisor=args.size_divisor)
    with tempfile.TemporaryDirectory() as folder:  # read back as a trace file is, checked alike
        path = Path(folder) / "trace.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return trace_workload(str(path), size="512x512", steps=20, guidance=7.5, sampler=None)


def check_contenders(names: list[str], specs: list[RequestSpec]) -> None:
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--contenders: a comma list of {list(CONTENDERS)} without repeats, got {names}")
    if "dvllm" not in names and "request" not in names:
        raise ValueError("--contenders must include dvllm or request: solo latencies are measured on an engine")
    if "serial" in names and any(s.loras or s.cache != SERVER_DEFAULT for s in specs):
        raise ValueError("the serial contender runs no LoRA or step-cache requests yet: leave it out of "
                         "--contenders for this trace")


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.entrypoints.cli_args import engine_kwargs

    specs = load_specs(args)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    check_contenders(names, specs)
    if args.rounds < 1 or not args.slo_factor > 0:
        raise ValueError("--rounds must be at least 1 and --slo-factor positive")
    kwargs = engine_kwargs(args)
    contenders: dict[str, Any] = {}
    try:
        for name in names:
            if name == "serial":
                from dvllm.benchmarks.baselines.runner import load_on_worker

                runner, worker = load_on_worker(model=kwargs["model"], load_format=kwargs["load_format"],
                                                device=kwargs["device"], dtype=kwargs["dtype"],
                                                dummy_weight_seed=kwargs["dummy_weight_seed"])
                contenders[name] = SerialContender(runner, worker)
            else:
                engine = AsyncDiffusionEngine(**{**kwargs, "batching": "step" if name == "dvllm" else "request"})
                engine.start()
                contenders[name] = EngineContender(name, engine)
        reference = contenders.get("dvllm") or contenders["request"]
        solos = await solo_latencies(reference, specs)
        slos = [args.slo_factor * solos[solo_key(s)] for s in specs]
        results: dict[str, Any] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                outcomes, duration = await replay(contenders[name], specs, r)
                records = [record(i, s, o, slo) for i, (s, o, slo) in enumerate(zip(specs, outcomes, slos))]
                summary = summarize(records, duration, None)
                firsts = [o.first_step for o in outcomes if o.first_step is not None]
                summary.update(first_step_p50_s=percentile(firsts, 50), first_step_p99_s=percentile(firsts, 99))
                results[name].append(summary)
    finally:
        for contender in contenders.values():
            await contender.close()
    return {"model": args.model, "requests": len(specs), "slo_factor": args.slo_factor, "rounds": args.rounds,
            "solo_kinds": len(solos), "contenders": results}


def format_results(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests on {result['model']}, SLO {result['slo_factor']:g}x solo latency "
             f"({result['solo_kinds']} kinds measured alone), {result['rounds']} round(s):"]
    header = f"  {'contender':<10}{'ok/failed':>10}{'req/s':>8}{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}" \
             f"{'1st step p50':>13}{'SLO met':>9}{'goodput':>9}"
    lines.append(header)
    for name, runs in result["contenders"].items():
        for s in runs:
            def f(v: float | None, d: int = 2) -> str:
                return "n/a" if v is None else f"{v:.{d}f}"
            lines.append(f"  {name:<10}{s['completed']:>5}/{s['failed']:<4}{f(s['requests_per_s']):>8}"
                         f"{f(s['latency_p50_s']):>8}{f(s['latency_p95_s']):>8}{f(s['latency_p99_s']):>8}"
                         f"{f(s['first_step_p50_s']):>13}{f(100 * (s['slo_attainment'] or 0), 0) + '%':>9}"
                         f"{f(s['goodput_rps']):>9}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run_async(args))
    print(format_results(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(json_safe(result), indent=2) + "\n")
    return 0
