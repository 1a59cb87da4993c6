"""The driver's side of data parallelism: one scheduler per worker, and which worker holds which request.

A request is placed on the least loaded live worker (fewest queued denoiser rows, then
most free blocks) and keeps its state there until it finishes; an idle worker takes
requests that have not started on a busier one. When a worker dies, its requests start
over from their seeds on the others, so their images do not change; a request that was
on every worker when it died fails rather than going round for ever. With one worker
(the in-process executor) this is exactly one scheduler.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from dvllm.config import EngineConfig
from dvllm.core.block_manager import BlockManager
from dvllm.core.request import Request, RequestStatus
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.core.stage_stats import STAGES, StageStats
from dvllm.errors import NoWorkerError, QueueFullError
from dvllm.executor.base import Executor
from dvllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

_STAT_KEYS = ("num_running", "num_waiting", "num_decoding", "num_preemptions", "pool_total_blocks", "pool_used_blocks",
              "pool_cached_blocks", "prompt_cache_hits", "prompt_cache_queries", "cache_skipped_rows",
              "cache_computed_rows", "lora_slot_loads", "loras_resident")


@dataclass(eq=False)
class Lane:
    """One worker as the driver sees it."""

    index: int
    scheduler: Scheduler | None            # None while the worker is dead
    in_flight: SchedulerOutput | None = None
    restarts: int = 0
    restarting: bool = False
    steps: int = 0                         # steps completed, rows in them, seconds they were in flight
    rows: int = 0
    busy_seconds: float = 0.0
    worker_seconds: float = 0.0            # of which the worker ran the step (the rest: transport, waiting)
    submitted_at: float = 0.0
    stages: StageStats = field(default_factory=StageStats)  # busy seconds and items per stage, since start

    @property
    def alive(self) -> bool:
        return self.scheduler is not None

    def start(self, sched_out: SchedulerOutput) -> None:
        self.in_flight, self.submitted_at = sched_out, time.perf_counter()

    def complete(self, result: RunnerOutput) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """Its step is done: the scheduler's update, and the step counted in the worker's statistics."""
        sched_out, self.in_flight = self.in_flight, None
        self.steps, self.rows = self.steps + 1, self.rows + sched_out.num_rows
        self.busy_seconds += time.perf_counter() - self.submitted_at
        self.worker_seconds += result.execute_seconds
        self.stages.merge(result.stages)
        return sched_out, self.scheduler.update_from_output(sched_out, result)


class Lanes:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.lanes = [Lane(i, self._new_scheduler(i)) for i in range(executor.num_workers)]
        self.block_numel = executor.pool_info(0)[1]
        self.home: dict[str, Lane] = {}          # request id -> the worker holding it
        self.orphans: list[Request] = []         # their worker died; waiting for one to come back
        self._no_worker_since: float | None = None
        self._last_heartbeat = time.monotonic()

    def _new_scheduler(self, index: int) -> Scheduler:
        num_blocks, _ = self.executor.pool_info(index)
        return Scheduler(self.config, BlockManager(num_blocks, self.config.enable_prompt_cache))

    # -- views -----------------------------------------------------------------
    def live(self) -> list[Lane]:
        return [lane for lane in self.lanes if lane.alive]

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.scheduler.waiting) for lane in self.live()) + len(self.orphans)

    @property
    def num_blocks(self) -> int:
        """The smallest live pool: what every request must fit."""
        return min(lane.scheduler.blocks.num_blocks for lane in self.live())

    def has_unfinished(self) -> bool:
        return bool(self.orphans) or any(
            lane.in_flight is not None or lane.scheduler.has_unfinished_requests() for lane in self.live())

    # -- requests in -------------------------------------------------------------
    def in_use(self, request_id: str) -> bool:
        """Whether a request of this id is held (queued, running, or waiting for a worker)."""
        return request_id in self.home or any(r.request_id == request_id for r in self.orphans)

    def add(self, request: Request) -> None:
        if self.in_use(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self.num_waiting >= self.config.max_num_waiting:  # the one queue bound, over all workers
            raise QueueFullError(f"{self.num_waiting} requests are waiting (max_num_waiting); retry later")
        if not self.live():
            self._check_recoverable()
        if self._place(request) is not None:  # some worker is alive or coming back, so it is placed
            raise NoWorkerError("no worker can take the request")

    def _place(self, request: Request, age: int = 0) -> RequestOutput | None:
        """Queues `request` on the least loaded live worker it has not died on; else it waits for a
        restart, or fails when no worker it could run on will come back."""
        untried = [lane for lane in self.live() if lane.index not in request.failed_workers]
        # a restarted worker may have profiled a smaller pool: only those it fits are candidates
        candidates = [lane for lane in untried if request.max_blocks <= lane.scheduler.blocks.num_blocks]
        if untried and not candidates:
            return _fail(request, f"it needs {request.max_blocks} state-pool blocks and no live worker's pool "
                                  "holds that many")
        if candidates:
            lane = min(candidates, key=lambda c: (c.scheduler.num_rows_queued, -c.scheduler.blocks.num_free, c.index))
            lane.scheduler.add_request(request, age=age)
            self.home[request.request_id] = lane
            return None
        if any(lane.restarting and lane.index not in request.failed_workers for lane in self.lanes):
            self.orphans.append(request)
            return None
        workers = sorted(request.failed_workers)
        return _fail(request, f"the request's worker died on every try (workers {workers}); no worker is left "
                              "that it has not failed on")

    def abort(self, request_id: str) -> RequestOutput | None:
        """The aborted request's final output; None when it is unknown."""
        lane = self.home.pop(request_id, None)
        if lane is not None:
            return lane.scheduler.abort_request(request_id)
        for request in self.orphans:
            if request.request_id == request_id:
                self.orphans.remove(request)
                return _end(request, RequestStatus.FINISHED_ABORTED, "request aborted")
        return None

    def finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.home.pop(out.request_id, None)

    # -- balance -------------------------------------------------------------------
    def rebalance(self, lane: Lane) -> None:
        """An idle worker takes requests that wait, unstarted, on others, while it can admit them."""
        if lane.scheduler.waiting or len(self.lanes) == 1:
            return
        rows: dict[tuple[int, int], int] = defaultdict(int)
        blocks = 0
        donors = sorted((d for d in self.live() if d is not lane and d.scheduler.waiting),
                        key=lambda d: -len(d.scheduler.waiting))
        for donor in donors:
            for request in donor.scheduler.unstarted():
                if lane.index in request.failed_workers:
                    continue
                if not lane.scheduler.can_admit(request, rows[request.shape_key], blocks):
                    return
                age = donor.scheduler.take_waiting(request)
                lane.scheduler.add_request(request, age=age)
                self.home[request.request_id] = lane
                rows[request.shape_key] += request.rows
                blocks += request.max_blocks

    # -- faults ----------------------------------------------------------------------
    def on_death(self, lane: Lane, reason: str) -> list[RequestOutput]:
        requests, outputs = lane.scheduler.evacuate(), []
        lane.scheduler, lane.in_flight = None, None
        logger.error("worker %d died (%s); %d request(s) start over on other workers", lane.index, reason,
                     len(requests))
        self._restart(lane)
        for request in requests:
            self.home.pop(request.request_id, None)
            request.failed_workers.add(lane.index)
            failed = self._place(request)
            if failed is not None:
                outputs.append(failed)
        return outputs

    def _restart(self, lane: Lane) -> None:
        if lane.restarts >= self.config.max_worker_restarts:
            logger.error("worker %d is given up: it was restarted %d time(s) (max_worker_restarts)", lane.index,
                         lane.restarts)
            return
        lane.restarts += 1
        lane.restarting = True
        try:
            self.executor.restart(lane.index)
        except Exception:  # noqa: BLE001 - the cluster said no; the engine goes on without it
            logger.exception("worker %d could not be restarted", lane.index)
            lane.restarting = False

    def tend(self, idle: bool = False) -> list[RequestOutput]:
        """Brings restarted workers in, places requests that waited for one, fails those that waited too long.
        `idle`: no step completed; with every worker down, wait a moment for one to come back (no spinning)."""
        if idle and self.orphans:
            time.sleep(0.05)
        for index, error in self.executor.poll_restarts().items():
            lane = self.lanes[index]
            lane.restarting = False
            if error is None:
                lane.scheduler = self._new_scheduler(index)
                logger.info("worker %d is back (restart %d)", index, lane.restarts)
            else:
                logger.error("worker %d failed to restart: %s", index, error)
                self._restart(lane)
        outputs: list[RequestOutput] = []
        if self.orphans and self.live():
            orphans, self.orphans = self.orphans, []
            outputs += [out for r in orphans if (out := self._place(r)) is not None]
        if not self.orphans or self.live():
            self._no_worker_since = None
            return outputs
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        gone = not any(lane.restarting for lane in self.lanes)
        if gone or now - self._no_worker_since > self.config.worker_restart_timeout_s:
            why = "no worker is left" if gone else \
                f"no worker came back within worker_restart_timeout_s={self.config.worker_restart_timeout_s}"
            outputs += [_fail(r, f"the request's worker died and {why}") for r in self.orphans]
            self.orphans = []
        return outputs

    def heartbeat(self) -> list[RequestOutput]:
        """Workers that died with no step in flight, found by the executor's heartbeat (at most every
        heartbeat_interval): their requests move now, not at their next step."""
        interval = self.executor.heartbeat_interval
        now = time.monotonic()
        if interval is None or now - self._last_heartbeat < interval:
            return []
        self._last_heartbeat = now
        outputs: list[RequestOutput] = []
        for index, reason in self.executor.check_health().items():
            lane = self.lanes[index]
            if lane.alive and lane.in_flight is None:
                outputs += self.on_death(lane, reason)
        return outputs

    def _check_recoverable(self) -> None:
        if not any(lane.restarting for lane in self.lanes):
            raise NoWorkerError("every worker is dead and none is being restarted; restart the engine")

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> dict:
        totals: dict[str, int] = defaultdict(int, dict.fromkeys(_STAT_KEYS, 0))  # all there, even with no worker
        for lane in self.live():
            for key, value in lane.scheduler.stats().items():
                totals[key] += value
        totals["num_waiting"] += len(self.orphans)
        totals["num_workers"] = len(self.lanes)
        totals["num_workers_alive"] = len(self.live())
        stages = StageStats()  # every worker's, the dead ones' included: counters never go back
        for lane in self.lanes:
            stages.merge(lane.stages)
        return {**totals, "stage_seconds": {name: stages.seconds.get(name, 0.0) for name in STAGES},
                "stage_items": {name: stages.items.get(name, 0) for name in STAGES}}

    def worker_stats(self) -> list[dict]:
        """Per worker: liveness, rows per step, steps per second in flight, the time per step the executor
        adds to the worker's own (transport, serialization, waiting for the driver), blocks used, restarts."""
        out = []
        for lane in self.lanes:
            s = lane.scheduler.stats() if lane.alive else {}
            out.append({
                "worker": lane.index, "alive": lane.alive, "restarts": lane.restarts, "steps": lane.steps,
                "rows_per_step": lane.rows / lane.steps if lane.steps else 0.0,
                "steps_per_s": lane.steps / lane.busy_seconds if lane.busy_seconds else 0.0,
                "overhead_ms_per_step": 1000 * (lane.busy_seconds - lane.worker_seconds) / lane.steps
                if lane.steps else 0.0,
                "num_running": s.get("num_running", 0), "num_waiting": s.get("num_waiting", 0),
                "pool_used_blocks": s.get("pool_used_blocks", 0), "pool_total_blocks": s.get("pool_total_blocks", 0),
                **self.executor.describe(lane.index),
            })
        return out


def _end(request: Request, status: RequestStatus, message: str) -> RequestOutput:
    """Finishes a request held by no worker's scheduler (one holds it otherwise, and ends it)."""
    request.status, request.error, request.finished_time = status, message, time.time()
    return request.output()


def _fail(request: Request, message: str) -> RequestOutput:
    return _end(request, RequestStatus.FINISHED_ERROR, message)
