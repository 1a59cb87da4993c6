"""DiffusionEngine: add requests, step, get outputs. `generate` is the offline loop on top."""
from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.request import Request
from dvllm.core.scheduler import Scheduler
from dvllm.decode_budget import DecodeBudget
from dvllm.engine.coordinator import Coordinator
from dvllm.engine.input_processor import InputProcessor
from dvllm.engine.result_cache import CachedResult, ResultCache
from dvllm.engine.start_checks import check_at_start
from dvllm.executor import create_executor
from dvllm.logging_setup import quiet_libraries
from dvllm.lora.registry import LoraRegistry, registry_for, require_registry
from dvllm.outputs import RequestMetrics, RequestOutput
from dvllm.profiler import PhaseTimer, breakdown
from dvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What the latest step() did: for metrics."""

    num_rows: int      # denoiser rows in its forward(s): one per worker that completed a step
    num_requests: int  # requests that took a step
    seconds: float


class DiffusionEngine:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        if self.config.engine_core_process:
            raise ValueError("engine_core_process: DiffusionEngine steps in the caller's process; "
                             "AsyncDiffusionEngine (and dvllm serve) can run the core in a process of its own")
        # each package's part resolved and checked; a typo'd adapter or file fails now, not after the model loads
        self.configs = check_at_start(self.config)
        with quiet_libraries():  # the libraries' loading chatter and bars, not the caller's own logging
            self.executor = create_executor(self.config)
            try:  # a refusal at start (a pair of options, a pool too small) leaves no process or group behind
                self._start()
            except BaseException:
                self.executor.shutdown()
                raise

    def _start(self) -> None:
        self.model_info = self.executor.model_info()
        self.loaded_model = self.executor.loaded_model()
        self._timer = PhaseTimer(self.config.profile_steps)  # the driver's phases: scheduling
        self.coordinator = Coordinator(self.config, self.configs.scheduler, self.executor, self._timer)
        self.block_numel = self.coordinator.block_numel
        pool_blocks = min(self.executor.pool_info(i)[0] for i in range(self.executor.num_workers))
        self.loras = registry_for(self.config, self.loaded_model.name)
        budgets = [self.executor.call(i, "decode_budget") for i in range(self.executor.num_workers)]
        self.processor = InputProcessor(self.config, self.model_info, self.block_numel, pool_blocks, self.loras,
                                        model_key=self._model_key(),
                                        decode_budget=functools.reduce(DecodeBudget.tightest, budgets))
        self.result_cache = ResultCache(self.config.result_cache_mb * 2**20)
        self._result_keys: dict[str, bytes] = {}  # request id -> result-cache key, while it runs
        self._generate_ids = itertools.count()
        # The one path for outputs not produced by a step: aborts, requests failed while no worker could
        # take them, and others' outputs that generate() saw; step() hands them out first.
        self._pending: list[RequestOutput] = []
        self.last_step = StepStats(0, 0, 0.0)
        self._profiled_steps, self._profiled_seconds = 0, 0.0
        self._check_pool_holds_a_default_request()
        for name, path in self.config.lora_modules.items():
            self.load_lora(name, path)

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler of the first worker (the only one with the in-process executor)."""
        return self.coordinator.cores[0].scheduler

    # -- the low-level loop ----------------------------------------------------
    def add_request(self, request_id: str, prompt: str, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        self.add_processed(self.processor.process(request_id, prompt, params, arrival_time))

    def add_processed(self, request: Request) -> None:
        """Queues a request the input processor made (the async engine processes off this thread); one
        the result cache holds is answered by the next step() instead, without reaching a scheduler."""
        request_id = request.request_id
        if any(out.request_id == request_id and out.metrics.result_cache_hit for out in self._pending):
            raise ValueError(f"request_id {request_id!r} is already in use")
        key = request.result_key if self.result_cache.enabled else None
        if key is not None:
            if self.coordinator.in_use(request_id):  # checked before the lookup, as coordinator.add would refuse it
                raise ValueError(f"request_id {request_id!r} is already in use")
            hit = self.result_cache.get(key)
            if hit is not None:
                self._pending.append(_cached_output(request, hit))
                return
        self.coordinator.add(request)
        if key is not None:
            self._result_keys[request_id] = key

    def step(self) -> list[RequestOutput]:
        """One engine iteration: the outputs not made by a step first, then the engine core's step (with data
        parallelism: every idle worker's, and the updates of those that are done)."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        outputs += self.coordinator.step()
        self._record(StepStats(*self.coordinator.last_step, time.perf_counter() - start))
        self.coordinator.finished(outputs)
        self._keep_results(outputs)
        return outputs

    def _keep_results(self, outputs: list[RequestOutput]) -> None:
        """Final images of keyed requests into the result cache (copies); failed or aborted ones only leave."""
        if not self._result_keys:
            return
        for out in outputs:
            if out.finished:
                key = self._result_keys.pop(out.request_id, None)
                if key is not None and out.ok:
                    self.result_cache.put(key, out.images, out.metrics.cached_steps)

    def _record(self, stats: StepStats) -> None:
        self.last_step = stats
        # Every step's time counts, those that only await decodes too (their phases are timed as well); the
        # step count is of denoising steps.
        self._profiled_seconds += stats.seconds
        if stats.num_requests:
            self._profiled_steps += 1

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its state; its final output (error "request aborted") comes from step()."""
        output = self.coordinator.abort(request_id)
        if output is not None:
            self._pending.append(output)
        return output is not None

    # -- LoRA adapters -----------------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        """Reads a LoRA adapter (diffusers' format: a folder or .safetensors file) and makes it available to
        requests as SamplingParams(loras={name: weight}); ValueError if it cannot serve it. Thread-safe: the
        checking read happens in the caller's thread; workers read it again, by path, into a slot when a request
        needs it."""
        self._lora_registry().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forgets an adapter: later requests naming it are refused; those already accepted finish with it."""
        self._lora_registry().unload(name)

    def valid_samplers(self) -> list[str]:
        """Short names and diffusers scheduler classes that run this model's default schedule."""
        return self.processor.valid_samplers()

    def list_loras(self) -> list[dict]:
        """The loaded adapters: name, path as given, the weights file it names, and that file's digest."""
        return [] if self.loras is None else self.loras.list()

    def _lora_registry(self) -> LoraRegistry:
        return require_registry(self.loras)

    def has_unfinished_requests(self) -> bool:
        return self.coordinator.has_unfinished() or bool(self._pending)

    @property
    def workers_restarting(self) -> bool:
        return self.coordinator.restarting

    @property
    def idle_poll_interval(self) -> float | None:
        """How often an idle engine must poll_workers(): restarts settling, or the workers' heartbeat."""
        if self.workers_restarting:
            return 0.5
        return self.executor.heartbeat_interval

    def poll_workers(self) -> None:
        """Brings in restarted workers and notices dead idle ones while there is no request to step
        (step() does it otherwise)."""
        self._pending += self.coordinator.poll()

    def profile(self) -> dict:
        """Where step time went, per phase (needs profile_steps=True): see dvllm.profiler.breakdown."""
        if not self.config.profile_steps:
            raise ValueError("profiling is off: create the engine with profile_steps=True")
        seconds = self._timer.snapshot()
        for worker_seconds in self.executor.collective_rpc("phase_seconds"):
            for phase, value in worker_seconds.items():
                seconds[phase] = seconds.get(phase, 0.0) + value
        return breakdown(seconds, self._profiled_seconds, self._profiled_steps)

    def stats(self) -> dict[str, int]:
        """Queue, preemption, state-pool and prompt-cache counters, summed over the live workers,
        how many workers there are and are alive, and the result cache's hits, queries, bytes, entries."""
        return {**self.coordinator.stats(), **self.result_cache.stats()}

    def worker_stats(self) -> list[dict]:
        """One entry per worker: alive, rows per step, steps/s, blocks used, restarts, where it runs."""
        return self.coordinator.worker_stats()

    def shutdown(self) -> None:
        """Stops the workers (Ray actors); the in-process worker just goes with the engine."""
        self.executor.shutdown()

    # -- offline batch ---------------------------------------------------------
    def generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order (failed ones carry `error`)."""
        with quiet_libraries():
            return self._generate(prompts, params, use_tqdm)

    def _generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            params_list = params
        else:
            params_list = [params] * len(prompts)
        # Check everything before queueing anything, so bad input leaves the engine untouched.
        requests = [self.processor.process(f"generate-{next(self._generate_ids)}", p, sp)
                    for p, sp in zip(prompts, params_list)]
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        pending = list(reversed(requests))
        bar = _progress_bar(len(requests), use_tqdm)
        start, images, done = time.perf_counter(), 0, 0
        while done < len(requests):
            while pending and self.coordinator.num_waiting < self.config.max_num_waiting:
                self.add_processed(pending.pop())
            for out in self.step():
                if out.request_id not in order:
                    self._pending.append(out)
                elif out.finished:
                    results[order[out.request_id]] = out
                    done += 1
                    images += len(out.images)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(images_per_s=f"{images / (time.perf_counter() - start):.2f}")
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    # -- helpers ---------------------------------------------------------------
    def _model_key(self) -> str:
        """What identifies the served model's pixels in result-cache keys: what was loaded, and how."""
        c = self.config
        return repr((self.loaded_model, c.load_format, c.dummy_weight_seed, c.vae, c.vae_tiling, c.vae_tile_size,
                     c.revision,
                     c.variant))

    def _check_pool_holds_a_default_request(self) -> None:
        """One image at the default size, with its sampler's history and both prompts (CFG)."""
        info, loaded, total = self.model_info, self.loaded_model, self.coordinator.num_blocks
        blocks, (height, width) = self.processor.blocks, (info.defaults.height, info.defaults.width)
        latents = (1 + self.processor.default_history_slots()) * blocks(info.latents.numel(*info.default_size))
        need = latents + 2 * blocks(info.text.condition_numel)
        if need > total:
            raise ValueError(f"the state pool is too small for even one default request: it needs {need} "
                             f"blocks and the pool has {total}; raise state_pool_mb")
        logger.info("serving %s (%s) on %s in %s: the state pool holds %d requests at the default %dx%d with CFG "
                    "(more where prompts repeat), %d rows in one forward", loaded.name, info.family, loaded.device,
                    loaded.dtype, total // need, width, height, self.config.max_batch_size)


def _cached_output(request: Request, hit: CachedResult) -> RequestOutput:
    """A result-cache hit's final output: what the first run's Request.output() gave, all steps done now."""
    now = time.time()
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt, seed=request.params.seed,
        num_inference_steps=request.num_steps, num_steps_done=request.num_steps, finished=True,
        metrics=RequestMetrics(request.arrival_time, now, now, cached_steps=hit.cached_steps, result_cache_hit=True),
        images=list(hit.images),
    )


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")
