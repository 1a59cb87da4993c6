"""EngineCore: one worker's engine. Its step is the whole loop of one worker: schedule, execute, update.

The in-process engine is one core and steps it as it reads, or with async scheduling one step ahead: the next
step is scheduled and queued on the worker's thread while this one runs, and the scheduler counts the steps in
flight as taken (progress is deterministic). A step's update, and any failure in it, then comes a step later.
Data parallelism (engine/coordinator.py)
drives several cores and splits each core's step around the executor (submit, then complete when the
worker is done) so that its workers step at the same time; with async scheduling each worker has its next
step submitted behind the one it runs (`submitted` holds both, oldest first).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.core.stage_stats import StageStats
from dvllm.executor.base import Executor
from dvllm.outputs import RequestOutput
from dvllm.profiler import PhaseTimer

# A gathering request-level batch: the engine sleeps this long at most before it looks again (new requests come in
# between, and may fill the batch)
HOLD_SLICE_S = 0.005


@dataclass(eq=False)
class EngineCore:
    index: int                             # the executor's worker
    scheduler: Scheduler | None            # None while the worker is dead
    executor: Executor
    timer: PhaseTimer                      # the driver's phases: scheduling
    restarts: int = 0
    restarting: bool = False
    steps: int = 0                         # steps completed, rows in them, seconds they were in flight
    rows: int = 0
    busy_seconds: float = 0.0
    worker_seconds: float = 0.0            # of which the worker ran the step (the rest: transport, waiting)
    # the coordinator's steps submitted and not yet complete, oldest first, with when each could start running
    submitted: deque[tuple[SchedulerOutput, float]] = field(default_factory=deque)
    stages: StageStats = field(default_factory=StageStats)  # busy seconds and items per stage, since start
    last_step: tuple[int, int] = (0, 0)    # the latest step's denoiser rows, and requests that stepped
    ahead: deque[tuple[SchedulerOutput, Future]] = field(default_factory=deque)  # async: in flight, oldest first
    stage_processes: list[dict] = field(default_factory=list)  # the worker's stage processes' heartbeats, as of its
    # latest step (RunnerOutput.stage_processes)

    @property
    def alive(self) -> bool:
        return self.scheduler is not None

    def step(self) -> list[RequestOutput]:
        """One iteration, start to end (the in-process worker runs it when it is submitted)."""
        sched_out = self.schedule()
        result = self.executor.execute(self.index, sched_out)
        return self.update(sched_out, result)

    def step_ahead(self, depth: int = 2) -> list[RequestOutput]:
        """Async scheduling: schedules a step and queues it on the worker's thread, then (with `depth` steps in
        flight, or nothing new to queue) waits for the oldest and returns its update. The worker goes from one
        step to the next without waiting for the scheduler."""
        sched_out = self.schedule()
        self.last_step = (0, 0)  # until a step's update comes back
        if not sched_out.is_empty:
            self.ahead.append((sched_out, self.executor.execute_ahead(self.index, sched_out)))
            if len(self.ahead) < depth:
                return []
        if not self.ahead:
            return []
        sched_out, done = self.ahead.popleft()
        return self.update(sched_out, done.result())

    @property
    def stepping(self) -> bool:
        """Whether a step is in flight."""
        return bool(self.submitted) or bool(self.ahead)

    def schedule(self) -> SchedulerOutput:
        with self.timer.phase("schedule"):
            sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.scheduler.hold_s > 0:  # a request-level batch gathering: sleep, not spin
            time.sleep(min(self.scheduler.hold_s, HOLD_SLICE_S))
        return sched_out

    def update(self, sched_out: SchedulerOutput, result: RunnerOutput, seconds: float | None = None) -> list[RequestOutput]:
        """The scheduler's update from the step's result, and the step counted in the worker's statistics
        (`seconds` in flight: the worker's own time when it ran in this thread)."""
        self.last_step = (sched_out.num_rows, len(sched_out.scheduled_ids))
        if not sched_out.is_empty:
            self.steps, self.rows = self.steps + 1, self.rows + sched_out.num_rows
            self.busy_seconds += result.execute_seconds if seconds is None else seconds
            self.worker_seconds += result.execute_seconds
            self.stages.merge(result.stages)
            self.stage_processes = result.stage_processes
        return self.scheduler.update_from_output(sched_out, result)

    # -- the coordinator's split of the same step ------------------------------------
    def submit(self, sched_out: SchedulerOutput) -> None:
        self.submitted.append((sched_out, time.perf_counter()))
        self.executor.submit(self.index, sched_out)

    def complete(self, result: RunnerOutput) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """Its oldest step is done: what was scheduled, and the scheduler's update. The step's time counts from
        its submission, or from the end of the step it was queued behind."""
        sched_out, start = self.submitted.popleft()
        now = time.perf_counter()
        if self.submitted:  # the next one runs from now on
            self.submitted[0] = (self.submitted[0][0], max(self.submitted[0][1], now))
        return sched_out, self.update(sched_out, result, now - start)
