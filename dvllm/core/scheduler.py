"""Step-level continuous batching: every iteration, one forward of whoever is ready.

There are no phases. A request is admitted when its shape group has rows free in a
forward and the state pool has blocks for it; it takes one denoising step in each
iteration its group is picked, and leaves as soon as its counter reaches its step
count. One group (latent shape) steps at a time: with shape_order="oldest" (what
"auto" is but under the elastic group policy) the group holding the most urgent
request (the earliest, under fcfs), so shapes run one after another as a
request-level server's batches do, later requests of the running shape joining it;
with "turns" the group holding the request that waited longest since its last step,
so with G groups no running request waits more than G - 1 iterations for a step
(shapes share the device: each finishes later).

With scheduling_policy="priority", a request that cannot be admitted for lack of
rows or blocks preempts less urgent running ones: their state is swapped to the
worker's host memory and comes back, unchanged, when they are readmitted. Urgency
ages: a request of priority p ranks with one of priority 0 that arrived
p * priority_aging_iterations iterations later, so low priorities are delayed,
never starved. The ranking never changes over time, so two requests cannot take
turns preempting each other.

With batching="request", the scheduler runs the request-level policy instead, to compare the two on the same
kernels: while a batch runs nothing is admitted; when it ends, the most urgent waiting request and those with its
batch key (request_batch_key) are admitted together and run to completion, after waiting up to
request_batch_wait_s for more of them (the engine sleeps meanwhile: `hold_s`).

With group_policy="elastic" (a worker group), deadlines count: a running request whose remaining steps would end
after its deadline at the present pace (each of its steps waiting for a step of every shape's ready rows, at the
recent seconds per row) but not if it stepped alone takes steps in a forward of its own with the other late
requests of its shape, ahead of the rest, until it would not.
"""
from __future__ import annotations

import time
from collections import defaultdict

from dvllm.core.batch_key import request_batch_key
from dvllm.core.block_manager import BlockManager
from dvllm.core.deadlines import Pace
from dvllm.core.encode_ahead import EncodeAhead, EncodeKey
from dvllm.core.lora_reads import LoraReads
from dvllm.core.lora_slots import LoraSlots
from dvllm.core.preemption import choose_pixel_victims, choose_victims
from dvllm.core.request import Request, RequestStatus
from dvllm.core.request_blocks import allocate_blocks, blocks_needed, can_allocate, free_blocks
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.core.scheduler_output import ResumedRequestData, RunnerOutput, SchedulerOutput
from dvllm.outputs import RequestOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_running_pixels = config.max_running_pixels
        self.prompt_chars_per_step = config.prompt_chars_per_step
        self.input_images_per_step = config.max_input_images_per_step
        self.by_priority = config.scheduling_policy == "priority"
        self.request_level = config.batching == "request"
        self.oldest_first = config.shape_order == "oldest"
        self.batch_wait = config.request_batch_wait_s
        self.hold_s = 0.0  # batching=request: how much longer the next batch gathers (the engine sleeps meanwhile)
        self.aging = config.priority_aging_iterations
        self.blocks = block_manager
        self.lora_slots = LoraSlots(config.max_loras)
        self.lora_reads = LoraReads(config.lora_cache_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Requests whose last step is done and whose latents are in the worker's decode stage: they hold no
        # blocks; their images come with a later step's output.
        self.decoding: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.iteration = 0
        # Priority aging's clock: iterations that ran a step. Those that only wait (for the encode stage, for
        # decodes: 50 a second while an encode process starts) are no one's turn, and must not age anyone
        self.steps_run = 0
        self.num_preemptions = 0
        self.cache_skipped_rows = self.cache_computed_rows = 0  # step caching, over the engine's life
        self.deadlines = {True: 0, False: 0}  # finished requests with a deadline: met, missed
        # The elastic group policy's deadline-first steps (None: deadlines are only reported)
        self.pace = Pace() if config.elastic else None
        self._freed: list[str] = []
        # By iteration, until its update: the requests it stepped, and request id -> the cache entries it filled
        self._batches: dict[int, list[Request]] = {}
        self._writers: dict[int, dict[str, list]] = {}
        # Aborted with a step in flight -> the last iteration that may still report on it (not on a new request
        # that takes its id meanwhile)
        self._stale: dict[str, int] = {}
        # With the worker's encode stage: the texts it encodes ahead of admission
        self.ahead = EncodeAhead(config.encode_ahead, always=config.encode_always) \
            if config.encode_ahead is not None else None

    # -- requests in and out -------------------------------------------------
    def add_request(self, request: Request, age: int = 0) -> None:
        """Queues a request the engine accepted: the input processor checked it, and the engine's coordinator
        bound the queue. `age` keeps the iterations it already waited on another worker (priority aging)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_iteration = self.steps_run - age
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def take_waiting(self, request: Request) -> int:
        """Removes a request that never started here (no state on the worker); returns its age."""
        if request.status != RequestStatus.WAITING or request.swapped or request not in self.waiting:
            raise ValueError(f"request {request.request_id!r} has state on this worker and cannot move")
        self.waiting.remove(request)
        del self.requests[request.request_id]
        return self.steps_run - request.arrival_iteration

    def unstarted(self) -> list[Request]:
        """Waiting requests with nothing on the worker, most urgent first: they may move to another worker."""
        return sorted((r for r in self.waiting if not r.swapped), key=self.urgency)

    def can_admit(self, request: Request, extra_rows: int = 0, extra_blocks: int = 0, extra_pixels: int = 0) -> bool:
        """Whether admission would take `request` now, without preempting anyone, after requests
        needing `extra_rows` of its shape, `extra_blocks` more and `extra_pixels` were admitted."""
        rows = sum(r.rows for r in self.running if r.shape_key == request.shape_key) + extra_rows
        return (rows + request.rows <= self.max_batch_size
                and self._pixels_fit(request, extra_pixels)
                and can_allocate(self.blocks, request, extra_blocks)
                and self.lora_slots.can_place(request.lora_adapters))

    @property
    def num_rows_queued(self) -> int:
        """Denoiser rows of every request here, running or waiting: this worker's load."""
        return sum(r.rows for r in self.requests.values())

    def evacuate(self) -> list[Request]:
        """The worker is gone with all its state: hands back every unfinished request, reset to start
        over from its seed. The scheduler is left empty."""
        requests = sorted(self.requests.values(), key=self.urgency)
        for request in requests:
            request.reset()
        self.requests, self.waiting, self.running, self.decoding = {}, [], [], {}
        self._freed, self._batches, self._writers, self._stale = [], {}, {}, {}
        if self.ahead is not None:
            self.ahead.clear()
        self.lora_slots = LoraSlots(self.lora_slots.num_slots)  # a new worker starts with empty slots
        self.lora_reads.clear()  # and has read nothing
        return requests

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Its final output (error "request aborted"), or None for an unknown id. A running request's
        state is freed on the worker with the next step (freed_ids)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if self.decoding.pop(request_id, None) is not None:
            self._freed.append(request_id)  # the stage drops its job if it has not begun it
        elif request.status == RequestStatus.RUNNING:
            if request.steps_in_flight:
                self._stale[request_id] = self.iteration
            self.running.remove(request)
            self._release(request)
            self._freed.append(request_id)
        else:
            self.waiting.remove(request)
            if request.swapped:
                self._freed.append(request_id)  # the worker drops its host copy
        self._finish(request, RequestStatus.FINISHED_ABORTED, "request aborted")
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.decoding or self._freed)

    def urgency(self, request: Request) -> tuple[int, int]:
        """Lower is more urgent: each priority level is worth `aging` steps of earlier arrival."""
        if not self.by_priority:
            return (0, request.arrival_seq)
        return (request.priority * self.aging + request.arrival_iteration, request.arrival_seq)

    # -- one iteration -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.iteration += 1
        out = SchedulerOutput(iteration=self.iteration)
        self.hold_s = 0.0
        self._admit(out)
        if self.ahead is not None:  # those left waiting behind a running batch: their texts, to the encode stage
            waiting = sorted(self.waiting, key=self.urgency) if self.running or self.ahead.always else []
            plan = self.ahead.plan(waiting, self.blocks)
            out.encode_images, out.encode_starts, out.encode_image_prompts = plan.images, plan.starts, \
                plan.image_prompts
            out.encode_jobs, out.encode_drops = plan.send, out.encode_drops + plan.drop
        batch = self._pick_batch()
        now = time.time()
        for request in batch:
            request.last_scheduled = self.iteration
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.pace.start(now)
        out.scheduled_ids = [r.request_id for r in batch]
        out.step_indices = [r.steps_scheduled for r in batch]
        out.finishing_ids = [r.request_id for r in batch if r.steps_scheduled + 1 == r.num_steps]
        for request in batch:
            request.steps_in_flight += 1
        if batch:
            self._batches[self.iteration] = batch
            self.steps_run += 1
        out.num_rows = sum(r.rows for r in batch)
        out.freed_ids, self._freed = self._freed, []
        idle = not (batch or out.new_requests or out.resumed_requests)
        out.await_decodes = bool(self.decoding) and idle
        # Requests wait for texts the encode stage is on and nothing else is to run: the worker waits for them
        out.await_encodes = idle and self.ahead is not None and not all(self.ahead.keys.values())
        out.lora_reads = self.lora_reads.take()
        out.await_lora_reads = idle and self.lora_reads.pending
        return out

    def _admit(self, out: SchedulerOutput) -> None:
        if self.by_priority:
            self.waiting.sort(key=self.urgency)
        rows = defaultdict(int)
        for request in self.running:  # not those whose last step is in flight: they take no row again
            if request.steps_scheduled < request.num_steps:
                rows[request.shape_key] += request.rows
        blocked = set()
        # While requests run, an adapter's file is read on the worker's reader thread and its request waits
        # (core/lora_reads.py); with none running, in the step that loads it (no one's step waits for it)
        running = bool(rows)
        # Prompts are tokenized and input images encoded on the step loop when their requests are admitted:
        # bound how much one iteration takes on, so a burst of long prompts or images cannot stall everyone's
        # next step.
        chars_budget, admitted_new = self.prompt_chars_per_step, False
        images_budget = self.input_images_per_step
        lora_blocked = False
        # While a batch runs, texts are encoded by the worker's encode stage, not here: wait for them
        gate = self.ahead is not None and (bool(self.running) or self.ahead.always)
        batch_key = None
        if self.request_level:
            if self.running or not self.waiting:
                return  # the running batch runs to completion: nothing joins it
            batch_key = request_batch_key(self.waiting[0])
            if self._gathering(batch_key):
                return
        for request in list(self.waiting):  # requests preempted below join the queue after this pass
            if batch_key is not None and request_batch_key(request) != batch_key:
                continue
            key = request.shape_key
            if key in blocked:
                continue
            if request.loras and lora_blocked:
                continue
            if gate and self.ahead.must_wait(request, self.blocks):
                continue
            if request.loras and self.lora_reads.must_wait(request.lora_adapters, self.lora_slots, running):
                # its adapters are being read; no later LoRA request takes the slots it will need meanwhile
                lora_blocked = not self.lora_slots.can_place(request.lora_adapters)
                continue
            chars = self._chars_to_encode(request)
            images = 0 if request.swapped else request.num_input_images
            if admitted_new and (chars > chars_budget or images > images_budget):
                break  # in order: it goes first next iteration
            if not self._pixels_fit(request) and not (self.by_priority and not self.request_level
                                                      and self._preempt_for_pixels(request, rows, out)):
                break  # in order: nobody overtakes it while the running requests fill max_running_pixels
            if not self._fits(request, rows):
                preempted = self.by_priority and not self.request_level and self._preempt_for(request, rows, out)
                if not (preempted and self._fits(request, rows)):
                    if not self.lora_slots.can_place(request.lora_adapters):
                        # Its adapters wait for slots that running requests hold; no later LoRA request takes a
                        # slot before it (it would never get one), requests without adapters go on.
                        lora_blocked = True
                        continue
                    if not can_allocate(self.blocks, request):
                        break  # blocks are shared by all shapes: nobody may overtake the head
                    blocked.add(key)  # rows are per shape: later requests of this shape wait behind it
                    continue
            rows[key] += request.rows
            if chars or images:
                chars_budget -= chars
                images_budget -= images
                admitted_new = True
            self._admit_one(request, out)

    def _gathering(self, key: tuple) -> bool:
        """batching=request with a window: the head's batch waits for more of its kind until request_batch_wait_s
        after the head arrived, or until its rows fill a batch."""
        waited = time.time() - self.waiting[0].arrival_time
        rows = sum(r.rows for r in self.waiting if request_batch_key(r) == key)
        self.hold_s = self.batch_wait - waited if waited < self.batch_wait and rows < self.max_batch_size else 0.0
        return self.hold_s > 0

    def _chars_to_encode(self, request: Request) -> int:
        """Characters of its texts that admission would have the worker encode (prompt-cache misses)."""
        if request.swapped:
            return 0
        texts = (request.prompt, request.params.negative_prompt or "")
        ready = self.ahead.ready_cache_keys(request) if self.ahead is not None else set()
        return sum(len(text) for key, text in zip(request.cond_keys, texts)
                   if key is not None and key not in ready and not self.blocks.is_cached(key))

    def _pixels_fit(self, request: Request, extra: int = 0) -> bool:
        """Whether `request` fits max_running_pixels beside the running requests that take a row again (not
        those whose last step is in flight) and `extra` more; alone, any request fits (a bound below one
        request's pixels must not leave it waiting forever)."""
        if self.max_running_pixels is None:
            return True
        running = extra + sum(r.pixels for r in self.running if r.steps_scheduled < r.num_steps)
        return not running or running + request.pixels <= self.max_running_pixels

    def _fits(self, request: Request, rows: dict) -> bool:
        return (rows[request.shape_key] + request.rows <= self.max_batch_size
                and can_allocate(self.blocks, request)
                and self.lora_slots.can_place(request.lora_adapters))

    def _preempt_for(self, request: Request, rows: dict, out: SchedulerOutput) -> bool:
        """Preempt the least urgent running requests that rank below `request`, if that makes it fit."""
        # not one whose last step is in flight (async scheduling): it is leaving
        candidates = sorted((r for r in self.running if self.urgency(r) > self.urgency(request)
                             and r.steps_scheduled < r.num_steps), key=self.urgency, reverse=True)
        victims = choose_victims(request, candidates, rows[request.shape_key] + request.rows - self.max_batch_size,
                                 blocks_needed(self.blocks, request) - self.blocks.num_available,
                                 self.lora_slots.shortfall(request.lora_adapters), self.blocks, self.lora_slots)
        for victim in victims or []:
            self._preempt(victim, rows, out)
        return victims is not None

    def _preempt_for_pixels(self, request: Request, rows: dict, out: SchedulerOutput) -> bool:
        """Preempt less urgent running requests whose pixels keep `request` over max_running_pixels, if that
        makes it fit (the bound delays requests by arrival, but never an urgent one behind a less urgent)."""
        running = [r for r in self.running if r.steps_scheduled < r.num_steps]
        candidates = sorted((r for r in running if self.urgency(r) > self.urgency(request)), key=self.urgency,
                            reverse=True)
        victims = choose_pixel_victims(request, candidates, sum(r.pixels for r in running),
                                       self.max_running_pixels)
        for victim in victims or []:
            self._preempt(victim, rows, out)
        return victims is not None

    def _preempt(self, victim: Request, rows: dict, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self._release(victim)
        rows[victim.shape_key] -= victim.rows
        victim.status, victim.swapped = RequestStatus.WAITING, True
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted_ids.append(victim.request_id)

    def _admit_one(self, request: Request, out: SchedulerOutput) -> None:
        tables, filled = allocate_blocks(self.blocks, request)
        if filled:  # shared entries (texts, control images) this request's step writes
            self._writers.setdefault(self.iteration, {})[request.request_id] = filled
        out.lora_loads += self.lora_slots.acquire(request.lora_adapters, self.iteration)
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        # Count its wait from now, as if it had just run: a stream of new arrivals must not
        # make its group look more starved than a group that is really waiting.
        request.last_scheduled = self.iteration - 1
        if request.swapped:
            out.resumed_requests.append(ResumedRequestData(request.request_id, tables))
            request.swapped = False
        else:
            out.new_requests.append(request.new_request_data(tables))
            if self.ahead is not None:
                out.encode_drops += self.ahead.used(request, (tables.write_cond, tables.write_uncond))

    def _release(self, request: Request) -> None:
        if request.blocks is not None:
            free_blocks(self.blocks, request)
            self.lora_slots.release(request.lora_adapters, self.iteration)

    def _pick_batch(self) -> list[Request]:
        groups: dict[tuple[int, int], list[Request]] = defaultdict(list)
        for request in self.running:
            if request.steps_scheduled < request.num_steps:  # else its last step is in flight
                groups[request.shape_key].append(request)
        if not groups:
            return []
        late = self.pace.late(groups) if self.pace is not None else []
        if late:
            self.pace.late_steps += 1
            first = min(late, key=lambda r: r.deadline_time)
            return [r for r in late if r.shape_key == first.shape_key]

        if self.oldest_first:
            return min(groups.values(), key=lambda group: min(self.urgency(r) for r in group))

        def staleness(group: list[Request]) -> tuple:
            return (min(r.last_scheduled for r in group), -sum(r.rows for r in group),
                    min(self.urgency(r) for r in group))

        return min(groups.values(), key=staleness)

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        now = time.time()
        for slot in runner_out.failed_lora_slots:
            self.lora_slots.forget(slot)
        self.lora_reads.update(runner_out.loras_read, runner_out.loras_dropped)
        if self.ahead is not None:
            self.ahead.mark_ready(runner_out.encoded)
            outputs += self._encode_failed(runner_out.encode_errors, now)
        writers, batch = self._writers.pop(sched_out.iteration, {}), self._batches.pop(sched_out.iteration, [])
        if self.pace is not None:
            self.pace.measure(batch, sched_out.num_rows, runner_out, self.requests)
        for request_id, message in runner_out.errors.items():
            if self._stale.get(request_id, -1) >= sched_out.iteration:
                continue  # an aborted request's, from a step scheduled before the abort
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            for entry in writers.get(request_id, []):
                self.blocks.invalidate(entry)  # its embedding may never have been written
            if request in self.running:
                self.running.remove(request)
            elif self.decoding.pop(request_id, None) is None:
                self.waiting.remove(request)
            self._release(request)
            self._finish(request, RequestStatus.FINISHED_ERROR, message, now)
            outputs.append(request.output())
        finishing, decoding = set(sched_out.finishing_ids), set(runner_out.decoding_ids)
        cached = set(runner_out.cached_ids)
        self.cache_skipped_rows += runner_out.cache_rows[0]
        self.cache_computed_rows += runner_out.cache_rows[1]
        self._stale = {k: last for k, last in self._stale.items() if last > sched_out.iteration}
        for request in batch:
            request_id = request.request_id
            request.steps_in_flight -= 1
            if self.requests.get(request_id) is not request:  # failed or aborted meanwhile
                continue
            request.num_steps_done += 1
            request.cached_steps += request_id in cached
            request.pace.record(now)
            if request_id in decoding:  # its images come later; its blocks are free now
                self.running.remove(request)
                self._release(request)
                self.decoding[request_id] = request
            elif request_id in finishing:
                images = runner_out.images.get(request_id)
                request.images = images or []
                self.running.remove(request)
                del self.requests[request_id]
                self._release(request)
                self._finish(request, RequestStatus.FINISHED if images else RequestStatus.FINISHED_ERROR,
                             None if images else "the worker returned no images for the request's last step", now)
            # a decoding request's last step is reported by its final output (unless previews come now)
            progress = request_id not in decoding or request_id in runner_out.previews
            if request.is_finished or (request.params.output_kind == "progress" and progress):
                outputs.append(request.output(runner_out.previews.get(request_id),
                                              runner_out.preview_steps.get(request_id)))
        # after the requests that went to the stage this step: their images may be back already
        return outputs + self._decoded(runner_out, set(sched_out.scheduled_ids), now)

    def _encode_failed(self, errors: dict[EncodeKey, str], now: float) -> list[RequestOutput]:
        """The waiting requests whose texts the encode stage could not encode fail (they hold nothing yet)."""
        outputs = []
        for request, message in self.ahead.failed(errors, self.waiting):
            self.waiting.remove(request)
            del self.requests[request.request_id]
            self._finish(request, RequestStatus.FINISHED_ERROR, message, now)
            outputs.append(request.output())
        return outputs

    def _decoded(self, runner_out: RunnerOutput, scheduled: set[str], now: float) -> list[RequestOutput]:
        """Outputs for what the decode stage finished since the last step: previews of requests not stepped
        now (the stepped ones carry theirs below), then the images of requests that were decoding."""
        outputs = []
        for request_id, previews in runner_out.previews.items():
            request = self.requests.get(request_id)
            if request is not None and request_id not in scheduled and request.params.output_kind == "progress":
                outputs.append(request.output(previews, runner_out.preview_steps.get(request_id)))
        for request_id, images in runner_out.images.items():
            request = self.decoding.pop(request_id, None)
            if request is None:  # aborted while it decoded
                continue
            del self.requests[request_id]
            request.images = images
            self._finish(request, RequestStatus.FINISHED if images else RequestStatus.FINISHED_ERROR,
                         None if images else "the decode returned no images", now)
            outputs.append(request.output())
        return outputs

    def _finish(self, request: Request, status: RequestStatus, error: str | None, now: float | None = None) -> None:
        request.status = status
        request.error = error
        request.finished_time = now or time.time()
        if request.deadline_met is not None:
            self.deadlines[request.deadline_met] += 1

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_decoding": len(self.decoding),
            "num_encoding": 0 if self.ahead is None else len(self.ahead.keys),
            "num_preemptions": self.num_preemptions,
            "cache_skipped_rows": self.cache_skipped_rows,
            "cache_computed_rows": self.cache_computed_rows,
            "pool_total_blocks": self.blocks.num_blocks,
            "pool_used_blocks": self.blocks.num_used_blocks,
            "pool_cached_blocks": self.blocks.num_cached_blocks,
            "prompt_cache_hits": self.blocks.cache_hits,
            "prompt_cache_queries": self.blocks.cache_queries,
            "lora_slot_loads": self.lora_slots.loads,
            "loras_resident": self.lora_slots.num_resident,
            "deadlines_met": self.deadlines[True],
            "deadlines_missed": self.deadlines[False],
            "late_steps": 0 if self.pace is None else self.pace.late_steps,
        }
