"""DiffusionEngine: add requests, step, get outputs. `generate` is the offline loop on top."""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from dvllm.config import EngineConfig
from dvllm.core.block_manager import BlockManager
from dvllm.core.request import Request
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_output import RunnerOutput
from dvllm.executor.uniproc import UniProcExecutor
from dvllm.outputs import RequestOutput
from dvllm.profiler import PhaseTimer, breakdown
from dvllm.samplers import SamplerPlan, build_plan
from dvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepStats:
    """What the latest step() did: for metrics."""

    num_rows: int      # denoiser rows in its forward
    num_requests: int  # requests that took a step
    seconds: float


class DiffusionEngine:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.executor = UniProcExecutor(self.config)
        self.model_info = self.executor.model_info()
        num_blocks, self.block_numel = self.executor.pool_info()
        self.scheduler = Scheduler(self.config, BlockManager(num_blocks, self.config.enable_prompt_cache))
        self._plans: OrderedDict[tuple, SamplerPlan] = OrderedDict()
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._undelivered: list[RequestOutput] = []  # outputs of others' requests seen inside generate()
        self.last_step = StepStats(0, 0, 0.0)
        self._timer = PhaseTimer(self.config.profile_steps)  # the driver's phases: scheduling
        self._profiled_steps, self._profiled_seconds = 0, 0.0
        self._check_pool_holds_a_default_request()

    # -- the low-level loop ----------------------------------------------------
    def add_request(self, request_id: str, prompt: str, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        self.scheduler.add_request(self._make_request(request_id, prompt, params, arrival_time))

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        with self._timer.phase("schedule"):
            sched_out = self.scheduler.schedule()
        runner_out = RunnerOutput() if sched_out.is_empty else self.executor.execute(sched_out)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self.last_step = StepStats(sched_out.num_rows, len(sched_out.scheduled_ids), time.perf_counter() - start)
        if sched_out.scheduled_ids:
            self._profiled_steps += 1
            self._profiled_seconds += self.last_step.seconds
        if self._undelivered:
            outputs, self._undelivered = self._undelivered + outputs, []
        return outputs

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its state; its final output (error "request aborted") comes from step()."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._undelivered)

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
        """Queue, preemption, state-pool and prompt-cache counters."""
        return self.scheduler.stats()

    # -- offline batch ---------------------------------------------------------
    def generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order (failed ones carry `error`)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            params_list = params
        else:
            params_list = [params] * len(prompts)
        # Check everything before queueing anything, so bad input leaves the engine untouched.
        requests = [self._make_request(f"generate-{next(self._generate_ids)}", p, sp)
                    for p, sp in zip(prompts, params_list)]
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        pending = list(reversed(requests))
        bar = _progress_bar(len(requests), use_tqdm)
        start, images, done = time.perf_counter(), 0, 0
        while done < len(requests):
            while pending and len(self.scheduler.waiting) < self.config.max_num_waiting:
                self.scheduler.add_request(pending.pop())
            for out in self.step():
                if out.request_id not in order:
                    self._undelivered.append(out)
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
    def _make_request(self, request_id: str, prompt: str, params: SamplingParams | None,
                      arrival_time: float | None = None) -> Request:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        resolved = (params or SamplingParams()).resolve(self.model_info, self.config)
        info = self.model_info
        plan = self._plan(resolved)
        request = Request(
            request_id=request_id, prompt=prompt, params=resolved, num_steps=plan.num_steps,
            cfg=info.uses_cfg(resolved.guidance_scale, resolved.negative_prompt), plan=plan,
            arrival_time=time.time() if arrival_time is None else arrival_time, arrival_seq=next(self._arrivals),
            latent_blocks=self._blocks(info.latent_numel(resolved.height, resolved.width)),
            cond_blocks=self._blocks(info.condition_numel), uses_history=plan.uses_history,
        )
        self.scheduler.check_fits(request)
        return request

    def _check_pool_holds_a_default_request(self) -> None:
        """One image at the default size, with history (multistep samplers) and both prompts (CFG)."""
        info, total = self.model_info, self.scheduler.blocks.num_blocks
        need = 2 * self._blocks(info.latent_numel(info.default_height, info.default_width)) \
            + 2 * self._blocks(info.condition_numel)
        if need > total:
            raise ValueError(f"the state pool is too small for even one default request: it needs {need} "
                             f"blocks and the pool has {total}; raise state_pool_mb")

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_numel)

    def _plan(self, params: SamplingParams) -> SamplerPlan:
        info, steps = self.model_info, params.num_inference_steps
        extra = info.timestep_kwargs(params.height, params.width, steps, info.scheduler_config) \
            if info.timestep_kwargs else {}
        key = (params.sampler, steps, params.strength, tuple(sorted((k, _hashable(v)) for k, v in extra.items())))
        plan = self._plans.get(key)
        if plan is None:
            plan = build_plan(info.scheduler_config, params.sampler, steps, params.strength, **extra)
            self._plans[key] = plan
            if len(self._plans) > self.config.sampler_plan_cache_size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, np.ndarray)) else value


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")
