"""The driver's side of data parallelism: one engine core per worker, and which worker holds which request.

With the in-process worker there is one core and the coordinator steps it as it is (engine/core.py):
nothing to place, balance or watch. With several workers (or one that can die: a Ray actor), a request is placed on the least loaded live worker (fewest queued denoiser rows, then
most free blocks) and keeps its state there until it finishes; an idle worker takes
requests that have not started on a busier one. When a worker dies, its requests start
over from their seeds on the others, so their images do not change; a request that was
on every worker when it died fails rather than going round for ever.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict

from dvllm.config import EngineConfig
from dvllm.core.block_manager import BlockManager
from dvllm.core.request import Request, RequestStatus
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.core.stage_stats import GROUP_SPLITS, STAGES, StageStats
from dvllm.engine.core import EngineCore
from dvllm.errors import NoWorkerError, QueueFullError
from dvllm.executor.base import Executor, WorkerDied
from dvllm.outputs import RequestOutput
from dvllm.profiler import PhaseTimer

logger = logging.getLogger(__name__)

_STAT_KEYS = ("num_running", "num_waiting", "num_decoding", "num_encoding", "num_preemptions", "pool_total_blocks",
              "pool_used_blocks", "pool_cached_blocks", "prompt_cache_hits", "prompt_cache_queries", "cache_skipped_rows",
              "cache_computed_rows", "lora_slot_loads", "loras_resident", "deadlines_met", "deadlines_missed",
              "late_steps")


# What can die and be started again under a worker: the stages' threads and processes, a group's members (all
# started again at once: one count per reform)
RESTART_KEYS = ("encode_stage.thread", "encode_stage.process", "decode_stage.thread", "decode_stage.process",
                "worker_group.members")
# Of those, the processes whose calls have a bound (stage_process.CallBounds)
TIMEOUT_KEYS = ("encode_stage.process", "decode_stage.process", "worker_group.members")


class Coordinator:
    def __init__(self, config: EngineConfig, scheduler: SchedulerConfig, executor: Executor,
                 timer: PhaseTimer) -> None:
        self.config, self.scheduler_config = config, scheduler
        self.executor = executor
        self.cores = [EngineCore(i, self._new_scheduler(i), executor, timer) for i in range(executor.num_workers)]
        # the in-process worker: one core, stepped as it is (it cannot die apart from the engine)
        self.single = self.cores[0] if executor.in_process else None
        self.block_numel = executor.pool_info(0)[1]
        self.last_step = (0, 0)                  # the latest step's denoiser rows and requests that stepped
        self.home: dict[str, EngineCore] = {}    # request id -> the worker holding it
        self.orphans: list[Request] = []         # their worker died; waiting for one to come back
        self._no_worker_since: float | None = None
        self._last_heartbeat = time.monotonic()

    def _new_scheduler(self, index: int) -> Scheduler:
        num_blocks, _ = self.executor.pool_info(index)
        return Scheduler(self.scheduler_config, BlockManager(num_blocks, self.scheduler_config.prompt_cache))

    # -- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The single core's step; or a step on every idle worker (with async scheduling, also one queued behind
        each running step), then the updates of the steps that are done (at least one when any is running:
        workers step independently, a slow one holds no other back)."""
        if self.single is not None:
            outputs = self.single.step_ahead() if self.config.async_scheduling else self.single.step()
            self.last_step = self.single.last_step
            return outputs
        depth = 2 if self.config.async_scheduling else 1  # async: the next step queued behind the running one
        for core in self.live():
            while len(core.submitted) < depth:
                if not core.submitted:
                    self.rebalance(core)
                sched_out = core.schedule()
                if sched_out.is_empty:
                    break
                core.submit(sched_out)
        done = self.executor.wait() if any(core.submitted for core in self.live()) else {}
        outputs: list[RequestOutput] = []
        rows = requests = 0
        for index, result in done.items():
            core = self.cores[index]
            if isinstance(result, WorkerDied):
                outputs += self.on_death(core, result.reason)
                continue
            sched_out, updates = core.complete(result)
            outputs += updates
            rows, requests = rows + sched_out.num_rows, requests + len(sched_out.scheduled_ids)
        self.last_step = (rows, requests)
        return outputs + self.tend(idle=not done) + self.heartbeat()

    def poll(self) -> list[RequestOutput]:
        """Between steps, while the engine is idle: restarted workers in, dead idle ones noticed."""
        return self.tend() + self.heartbeat()

    @property
    def restarting(self) -> bool:
        return any(core.restarting for core in self.cores)

    # -- views -----------------------------------------------------------------
    def live(self) -> list[EngineCore]:
        return [core for core in self.cores if core.alive]

    @property
    def num_waiting(self) -> int:
        return sum(len(core.scheduler.waiting) for core in self.live()) + len(self.orphans)

    @property
    def num_blocks(self) -> int:
        """The smallest live pool: what every request must fit."""
        return min(core.scheduler.blocks.num_blocks for core in self.live())

    def has_unfinished(self) -> bool:
        return bool(self.orphans) or any(
            core.stepping or core.scheduler.has_unfinished_requests() for core in self.live())

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
        if not self._place(request):
            raise NoWorkerError(f"no worker can take the request: {self._why_unplaced(request)}")

    def _untried(self, request: Request) -> list[EngineCore]:
        """The live workers `request` has not died on."""
        return [core for core in self.live() if core.index not in request.failed_workers]

    def _place(self, request: Request) -> bool:
        """Queues `request` on the least loaded live worker it has not died on and whose pool holds it, or keeps it
        for a worker coming back; False when neither can be (_why_unplaced says why)."""
        untried = self._untried(request)
        # a restarted worker may have profiled a smaller pool: only those it fits are candidates
        candidates = [core for core in untried if request.max_blocks <= core.scheduler.blocks.num_blocks]
        if candidates:
            core = min(candidates, key=lambda c: (c.scheduler.num_rows_queued, -c.scheduler.blocks.num_free, c.index))
            core.scheduler.add_request(request)
            self.home[request.request_id] = core
            return True
        if not untried and any(core.restarting and core.index not in request.failed_workers for core in self.cores):
            self.orphans.append(request)
            return True
        return False

    def _why_unplaced(self, request: Request) -> str:
        if self._untried(request):
            return f"it needs {request.max_blocks} state-pool blocks and no live worker's pool holds that many"
        return (f"the request's worker died on every try (workers {sorted(request.failed_workers)}); no worker is "
                "left that it has not failed on")

    def _place_or_fail(self, request: Request) -> list[RequestOutput]:
        """[] when placed (or kept for a restart), else the request's failed output."""
        return [] if self._place(request) else [_fail(request, self._why_unplaced(request))]

    def abort(self, request_id: str) -> RequestOutput | None:
        """The aborted request's final output; None when it is unknown."""
        core = self.home.pop(request_id, None)
        if core is not None:
            return core.scheduler.abort_request(request_id)
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
    def rebalance(self, core: EngineCore) -> None:
        """An idle worker takes requests that wait, unstarted, on others, while it can admit them."""
        if core.scheduler.waiting or len(self.cores) == 1:
            return
        rows: dict[tuple[int, int], int] = defaultdict(int)
        blocks = pixels = 0
        donors = sorted((d for d in self.live() if d is not core and d.scheduler.waiting),
                        key=lambda d: -len(d.scheduler.waiting))
        for donor in donors:
            for request in donor.scheduler.unstarted():
                if core.index in request.failed_workers:
                    continue
                if not core.scheduler.can_admit(request, rows[request.shape_key], blocks, pixels):
                    return
                age = donor.scheduler.take_waiting(request)
                core.scheduler.add_request(request, age=age)
                self.home[request.request_id] = core
                rows[request.shape_key] += request.rows
                blocks += request.max_blocks
                pixels += request.pixels

    # -- faults ----------------------------------------------------------------------
    def on_death(self, core: EngineCore, reason: str) -> list[RequestOutput]:
        requests, outputs = core.scheduler.evacuate(), []
        core.scheduler = None
        core.submitted.clear()
        logger.error("worker %d died (%s); %d request(s) start over on other workers", core.index, reason,
                     len(requests))
        self._restart(core)
        for request in requests:
            self.home.pop(request.request_id, None)
            request.failed_workers.add(core.index)
            outputs += self._place_or_fail(request)
        return outputs

    def _restart(self, core: EngineCore) -> None:
        if core.restarts >= self.config.max_worker_restarts:
            logger.error("worker %d is given up: it was restarted %d time(s) (max_worker_restarts)", core.index,
                         core.restarts)
            return
        core.restarts += 1
        core.restarting = True
        try:
            self.executor.restart(core.index)
        except Exception:  # noqa: BLE001 - the cluster said no; the engine goes on without it
            logger.exception("worker %d could not be restarted", core.index)
            core.restarting = False

    def tend(self, idle: bool = False) -> list[RequestOutput]:
        """Brings restarted workers in, places requests that waited for one, fails those that waited too long.
        `idle`: no step completed; with every worker down, wait a moment for one to come back (no spinning)."""
        if idle and self.orphans:
            time.sleep(0.05)
        for index, error in self.executor.poll_restarts().items():
            core = self.cores[index]
            core.restarting = False
            if error is None:
                core.scheduler = self._new_scheduler(index)
                logger.info("worker %d is back (restart %d)", index, core.restarts)
            else:
                logger.error("worker %d failed to restart: %s", index, error)
                self._restart(core)
        outputs: list[RequestOutput] = []
        if self.orphans and self.live():
            orphans, self.orphans = self.orphans, []
            outputs += [out for r in orphans for out in self._place_or_fail(r)]
        if not self.orphans or self.live():
            self._no_worker_since = None
            return outputs
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        gone = not any(core.restarting for core in self.cores)
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
            core = self.cores[index]
            if core.alive and not core.submitted:
                outputs += self.on_death(core, reason)
        return outputs

    def _check_recoverable(self) -> None:
        if not any(core.restarting for core in self.cores):
            raise NoWorkerError("every worker is dead and none is being restarted; restart the engine")

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> dict:
        totals: dict[str, int] = defaultdict(int, dict.fromkeys(_STAT_KEYS, 0))  # all there, even with no worker
        for core in self.live():
            for key, value in core.scheduler.stats().items():
                totals[key] += value
        totals["num_waiting"] += len(self.orphans)
        totals["num_workers"] = len(self.cores)
        totals["num_workers_alive"] = len(self.live())
        stages = StageStats()  # every worker's, the dead ones' included: counters never go back
        for core in self.cores:
            stages.merge(core.stages)
        return {**totals, "stage_seconds": {name: stages.seconds.get(name, 0.0) for name in STAGES},
                "stage_items": {name: stages.items.get(name, 0) for name in STAGES},
                "stage_restarts": {key: stages.restarts.get(key, 0) for key in RESTART_KEYS},
                "stage_timeouts": {key: stages.timeouts.get(key, 0) for key in TIMEOUT_KEYS},
                "group_forwards": {split: stages.group_forwards.get(split, 0) for split in GROUP_SPLITS}}

    def worker_stats(self) -> list[dict]:
        """Per worker: liveness, rows per step, steps per second in flight, the time per step the executor
        adds to the worker's own (transport, serialization, waiting for the driver), blocks used, restarts, its
        stage processes' heartbeats as of its latest step."""
        out = []
        for core in self.cores:
            s = core.scheduler.stats() if core.alive else {}
            out.append({
                "worker": core.index, "alive": core.alive, "restarts": core.restarts, "steps": core.steps,
                "rows_per_step": core.rows / core.steps if core.steps else 0.0,
                "steps_per_s": core.steps / core.busy_seconds if core.busy_seconds else 0.0,
                "overhead_ms_per_step": 1000 * (core.busy_seconds - core.worker_seconds) / core.steps
                if core.steps else 0.0,
                "num_running": s.get("num_running", 0), "num_waiting": s.get("num_waiting", 0),
                "pool_used_blocks": s.get("pool_used_blocks", 0), "pool_total_blocks": s.get("pool_total_blocks", 0),
                "stage_processes": core.stage_processes,
                **self.executor.describe(core.index),
            })
        return out


def _end(request: Request, status: RequestStatus, message: str) -> RequestOutput:
    """Finishes a request held by no worker's scheduler (one holds it otherwise, and ends it)."""
    request.status, request.error, request.finished_time = status, message, time.time()
    return request.output()


def _fail(request: Request, message: str) -> RequestOutput:
    return _end(request, RequestStatus.FINISHED_ERROR, message)
