"""Step-level continuous batching: every iteration, one forward of whoever is ready.

There are no phases. A request is admitted when its shape group has room for its
rows, takes one denoising step in each iteration its group is picked, and leaves
as soon as its counter reaches its step count. Groups (latent shapes) take turns:
the group holding the request that waited longest since its last step goes next,
so with G groups no running request waits more than G - 1 iterations for a step.
"""
from __future__ import annotations

import bisect
import time
from collections import defaultdict

from dvllm.config import EngineConfig
from dvllm.core.request import Request, RequestStatus
from dvllm.core.scheduler_output import NewRequestData, RunnerOutput, SchedulerOutput
from dvllm.errors import QueueFullError
from dvllm.outputs import RequestOutput


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_num_waiting = config.max_num_waiting
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: list[Request] = []  # in admission order
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.iteration = 0
        self._freed: list[str] = []
        self._aborted: list[Request] = []

    # -- requests in and out -------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """A request must fit in one forward even alone, or it could never run."""
        if request.rows > self.max_batch_size:
            raise ValueError(
                f"n={request.params.n} needs {request.rows} denoiser rows"
                f"{' (doubled by CFG)' if request.cfg else ''} but max_batch_size is {self.max_batch_size}"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_fits(request)
        if len(self.waiting) >= self.max_num_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_num_waiting); retry later")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._order)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._freed.append(request_id)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED, "request aborted")
        self._aborted.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._aborted or self._freed)

    def _order(self, request: Request) -> tuple[int, ...]:
        if self.by_priority:
            return (request.priority, request.arrival_seq)
        return (request.arrival_seq,)

    # -- one iteration -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.iteration += 1
        out = SchedulerOutput(iteration=self.iteration, new_requests=self._admit())
        batch = self._pick_batch()
        now = time.time()
        for request in batch:
            request.last_scheduled = self.iteration
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        out.scheduled_ids = [r.request_id for r in batch]
        out.freed_ids, self._freed = self._freed, []
        return out

    def _admit(self) -> list[NewRequestData]:
        rows = defaultdict(int)
        for request in self.running:
            rows[request.shape_key] += request.rows
        admitted, blocked = [], set()
        for request in list(self.waiting):
            key = request.shape_key
            if key in blocked:
                continue
            if rows[key] + request.rows > self.max_batch_size:
                blocked.add(key)  # later requests of this shape must not overtake it
                continue
            rows[key] += request.rows
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            # Count its wait from now, as if it had just run: a stream of new arrivals must not
            # make its group look more starved than a group that is really waiting.
            request.last_scheduled = self.iteration - 1
            admitted.append(_new_request_data(request))
        return admitted

    def _pick_batch(self) -> list[Request]:
        groups: dict[tuple[int, int], list[Request]] = defaultdict(list)
        for request in self.running:
            groups[request.shape_key].append(request)
        if not groups:
            return []

        def urgency(group: list[Request]) -> tuple:
            return (min(r.last_scheduled for r in group), -sum(r.rows for r in group),
                    min(self._order(r) for r in group))

        return min(groups.values(), key=urgency)

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[RequestOutput]:
        outputs = [r.output() for r in self._aborted]
        self._aborted = []
        now = time.time()
        for request_id, message in runner_out.errors.items():
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_ERROR, message, now)
                outputs.append(request.output())
        for request_id in sched_out.scheduled_ids:
            request = self.requests.get(request_id)
            if request is None:  # failed or aborted meanwhile
                continue
            request.num_steps_done += 1
            if request_id in runner_out.images:
                request.images = runner_out.images[request_id]
                self.running.remove(request)
                del self.requests[request_id]
                self._finish(request, RequestStatus.FINISHED, None, now)
            outputs.append(request.output())
        return outputs

    def _finish(self, request: Request, status: RequestStatus, error: str | None, now: float | None = None) -> None:
        request.status = status
        request.error = error
        request.finished_time = now or time.time()


def _new_request_data(request: Request) -> NewRequestData:
    p = request.params
    return NewRequestData(
        request_id=request.request_id, prompt=request.prompt, negative_prompt=p.negative_prompt, n=p.n,
        height=p.height, width=p.width, seed=p.seed, guidance_scale=p.guidance_scale, cfg=request.cfg,
        output_type=p.output_type, plan=request.plan,
    )
