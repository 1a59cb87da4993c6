"""Multi-LoRA serving, measured in one run (`benchmark_throughput.py --loras N`):

1. Throughput on one batch of requests (the same prompts, seeds and steps for every contender; request i
   takes adapter i mod N at weight 1.0), interleaved round by round:
   - dvllm without LoRA (the same requests, no adapters): what the adapters cost;
   - dvllm with the N adapters, all requests submitted at once (one batch mixing them);
   - dvllm given one adapter's requests at a time (the same engine, without mixing: what mixing gains);
   - the diffusers pipeline switching adapters per request, serially (all N loaded once with
     `load_lora_weights(adapter_name=...)`, `set_adapters([name])` before each request);
   - the diffusers pipeline run once per adapter on that adapter's requests as one static batch: what a
     server that batches only requests sharing an adapter set gets. The peer baseline.
2. Step cost: steady-state steps (no prompt encoding, no decode) of one batch of `--cost-rows` rows (one
   request each, no CFG) with no adapter, with one adapter on every row, and with row i taking adapter
   i mod N; the three take turns round by round (in a rotating order), each round's medians are taken
   relative to its own no-adapter one, and the median of those ratios is reported, so that machine noise
   hits each setup alike.

The adapters are random (lora_adapters.py), rank `--lora-rank`, on the denoiser's attention projections.
The pipeline baselines run a copy of the engine's denoiser (the same weights) with peft's layers in it, and
share the engine's text encoders and VAE, so that peft's wrappers never sit in dvllm's forward.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import diffusers
import torch

from dvllm.benchmarks.lora_adapters import make_adapters
from dvllm.benchmarks.throughput import Job, _machine, _timed, make_engine, make_jobs, static_batches
from dvllm.engine.engine import DiffusionEngine
from dvllm.models.base import denoiser_component
from dvllm.sampling_params import SamplingParams

NO_LORA, MIXED, GROUPED = "dvllm (no LoRA)", "dvllm+LoRA mixed batch", "dvllm+LoRA one adapter at a time"
PIPE_SERIAL, PIPE_GROUPED = "pipeline+LoRA serial", "pipeline+LoRA one batch per adapter"


def run(args: argparse.Namespace) -> dict:
    if args.loras < 1:
        raise ValueError(f"--loras must be at least 1, got {args.loras}")
    diffusers.utils.logging.set_verbosity_error()  # "no LoRA keys for the text encoder", Qwen's negative prompt
    jobs, names = make_jobs(args), [f"lora{i}" for i in range(args.loras)]
    rows = args.max_batch_size or max(16, 2 * len(jobs), args.cost_rows)
    engine = make_engine(args, rows, enable_lora=True, max_loras=args.loras, max_lora_rank=args.lora_rank)
    adapter = engine.executor.worker.runner.adapter
    base = _baseline_pipeline(adapter.pipeline)  # before any LoRA request: dvllm wraps its layers lazily
    with tempfile.TemporaryDirectory(prefix="dvllm-lora-bench-") as root:
        for name, path in make_adapters(adapter.pipeline, root, args.loras, args.lora_rank).items():
            engine.load_lora(name, path)
            with warnings.catch_warnings():  # peft: "multiple adapters in the model", which is the point
                warnings.simplefilter("ignore", UserWarning)
                base.load_lora_weights(path, adapter_name=name)
        times = _throughput(args, engine, base, [(j, names[i % len(names)]) for i, j in enumerate(jobs)])
        del base  # the copied denoiser, before the step cost's batch
        gc.collect()
        cost = step_cost(args, engine, names)
    ips = {name: len(jobs) / statistics.median(t) for name, t in times.items()}
    return {
        "machine": _machine(adapter.device, adapter.dtype), "args": vars(args), "adapters": args.loras,
        "rank": args.lora_rank, "images_per_s": ips, "seconds": times,
        "lora_vs_no_lora": ips[MIXED] / ips[NO_LORA], "lora_vs_pipeline_serial": ips[MIXED] / ips[PIPE_SERIAL],
        "lora_vs_pipeline_grouped": ips[MIXED] / ips[PIPE_GROUPED], "lora_vs_dvllm_grouped": ips[MIXED] / ips[GROUPED],
        "step_cost": cost,
    }


def _throughput(args: argparse.Namespace, engine: DiffusionEngine, base: Any,
                work: list[tuple[Job, str]]) -> dict[str, list[float]]:
    """Seconds per round of each contender on `work` (each job with its adapter)."""
    def generate(batch: list[tuple[Job, str]], lora: bool) -> None:
        params = [SamplingParams(num_inference_steps=j.steps, guidance_scale=j.guidance, height=j.height,
                                 width=j.width, seed=j.seed, loras={name: 1.0} if lora else None) for j, name in batch]
        outs = engine.generate([j.prompt for j, _ in batch], params, use_tqdm=False)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} dvllm requests failed: {failed[:3]}")

    pipeline = _pipeline_call(base)
    by_adapter: dict[str, list[tuple[Job, str]]] = defaultdict(list)
    for j, name in work:
        by_adapter[name].append((j, name))

    def pipe_serial() -> None:
        for j, name in work:
            base.set_adapters([name], adapter_weights=[1.0])
            pipeline([j])

    def pipe_grouped() -> None:
        for name, group in by_adapter.items():
            base.set_adapters([name], adapter_weights=[1.0])
            static_batches([j for j, _ in group], pipeline, len(group))()  # split only where steps, size... differ

    contenders: dict[str, Callable[[], Any]] = {
        NO_LORA: lambda: generate(work, lora=False), MIXED: lambda: generate(work, lora=True),
        GROUPED: lambda: [generate(group, lora=True) for group in by_adapter.values()],
        PIPE_SERIAL: pipe_serial, PIPE_GROUPED: pipe_grouped,
    }
    device = engine.executor.worker.runner.adapter.device
    for fn in contenders.values():  # warm-up round; it also puts every adapter in its slot
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(args.rounds):
        for k in range(len(names)):
            name = names[(round_ + k) % len(names)]  # a rotating order: no contender always runs first
            times[name].append(_timed(contenders[name], device))
    return times


def step_cost(args: argparse.Namespace, engine: DiffusionEngine, names: list[str], steps: int = 8) -> dict:
    """Steady-state step with no adapter, one adapter on every row, and row i on adapter i mod N, relative to
    no adapter: per round the median of each setup's steps over the no-LoRA one's, then the median over
    rounds, so that a slow stretch of a shared machine moves a round's setups alike. Guidance 1 keeps CFG off,
    so that rows are requests."""
    width, height = (int(v) for v in args.size.lower().split("x"))
    rows, n = args.cost_rows, len(names)
    setups: dict[str, Callable[[int], dict[str, float] | None]] = {
        "no LoRA": lambda i: None, "1 adapter on every row": lambda i: {names[0]: 1.0},
        f"{n} adapters, row i on adapter i mod {n}": lambda i: {names[i % n]: 1.0},
    }
    order = list(setups)
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    plain: list[float] = []
    for round_ in range(args.cost_rounds + 1):  # the first round warms up
        times: dict[str, list[float]] = {}
        for k in range(len(order)):
            setup = order[(round_ + k) % len(order)]  # a rotating order: no setup always runs first
            times[setup] = _steps(engine, f"cost-{round_}-{k}", rows, steps, lambda i, loras=setups[setup]:
                                  SamplingParams(num_inference_steps=steps, guidance_scale=1.0, height=height,
                                                 width=width, seed=i, output_type="latent", loras=loras(i)))
        if round_:
            base = statistics.median(times["no LoRA"])
            plain += times["no LoRA"]
            for name, t in times.items():
                ratios[name].append(statistics.median(t) / base)
    summary = {name: statistics.median(r) for name, r in ratios.items()}
    return summary | {"no_lora_step_ms": 1000 * statistics.median(plain), "rounds": ratios}


def _steps(engine: DiffusionEngine, prefix: str, rows: int, steps: int,
           params: Callable[[int], SamplingParams]) -> list[float]:
    """Seconds of each step of one batch of `rows` requests after its first (prompt encoding) and before its
    last (output)."""
    for i in range(rows):
        engine.add_request(f"{prefix}-{i}", "a photo", params(i))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        engine.step()
        if 1 <= step < steps - 1:
            times.append(time.perf_counter() - start)
            if engine.last_step.num_rows != rows:
                raise RuntimeError(f"the step-cost batch ran {engine.last_step.num_rows} rows, not {rows}: "
                                   f"max_batch_size must hold them all in one forward")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def _baseline_pipeline(pipe: Any) -> Any:
    """The engine's pipeline with its own copy of the denoiser (peft rewrites the modules it adapts)."""
    component = denoiser_component(pipe)
    base = type(pipe)(**{**pipe.components, component: copy.deepcopy(getattr(pipe, component))})
    base.set_progress_bar_config(disable=True)
    return base


def _pipeline_call(pipe: Any) -> Callable[[list[Job]], None]:
    guidance_name = "true_cfg_scale" if type(pipe).__name__ == "QwenImagePipeline" else "guidance_scale"

    def call(batch: list[Job]) -> None:
        j = batch[0]
        pipe([b.prompt for b in batch], num_inference_steps=j.steps, height=j.height, width=j.width,
             generator=[torch.Generator("cpu").manual_seed(b.seed) for b in batch], output_type="pil",
             **{guidance_name: j.guidance})
    return call


def print_report(result: dict) -> None:
    args, ips = result["args"], result["images_per_s"]
    print(f"\nmodel={args['model']} workload={args['workload']} requests={args['num_requests']} steps={args['steps']} "
          f"size={args['size']} guidance={args['guidance']} adapters={result['adapters']} (rank {result['rank']}, "
          f"round-robin, weight 1.0)  [{result['machine']}]")
    print(f"{'engine':<38}{'images/s':>10}{'mixed batch vs this':>21}")
    for name, value in ips.items():
        print(f"{name:<38}{value:>10.2f}{ips[MIXED] / value:>20.2f}x")
    print(f"\ndvllm+LoRA mixed / dvllm no LoRA = {result['lora_vs_no_lora']:.2f}x   "
          f"/ pipeline serial = {result['lora_vs_pipeline_serial']:.2f}x   "
          f"/ pipeline one batch per adapter = {result['lora_vs_pipeline_grouped']:.2f}x   "
          f"/ dvllm one adapter at a time = {result['lora_vs_dvllm_grouped']:.2f}x")
    cost = dict(result["step_cost"])
    rounds = cost.pop("rounds")
    print(f"\nstep time, batch of {args['cost_rows']} rows (no LoRA step {cost.pop('no_lora_step_ms'):.1f} ms; median "
          f"over rounds of each round's ratio, the rounds' ratios after it):")
    for name, ratio in cost.items():
        print(f"  {name:<40}{ratio:>6.3f}x the no-LoRA step   [{' '.join(f'{r:.2f}' for r in rounds[name])}]")
