"""One iteration on the worker as the list of stages it runs (model_runner.py lists them), and what each stage
leaves for the next (StepWork).

A stage either runs once on the whole step, or on its requests (`items`): then it runs on them together, and if
that raises, on each alone, so that only the requests that still fail are dropped (per_request.py). That retry is
applied here, for every stage alike, not inside the stages.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.core.stage_stats import StageStats
from dvllm.profiler import PhaseTimer
from dvllm.worker.per_request import per_request
from dvllm.worker.request_state import RequestState


@dataclass
class StepWork:
    """The scheduler's diff for this iteration, and what the stages found so far."""

    out: SchedulerOutput
    errors: dict[str, str] = field(default_factory=dict)       # request -> why it failed (it goes no further)
    stats: StageStats = field(default_factory=StageStats)
    failed_loras: dict[str, tuple[int, str]] = field(default_factory=dict)  # adapter digest -> (its slot, why)
    unwritten: dict[tuple[int, ...], str] = field(default_factory=dict)   # prompt-cache blocks left empty -> why
    admitting: list[Any] = field(default_factory=list)         # new requests that reached prompt encoding
    ready: list[Any] = field(default_factory=list)             # of those, the ones whose prompts were written
    batch: list[RequestState] = field(default_factory=list)    # the requests this step denoises
    x0: dict[str, Any] = field(default_factory=dict)           # previews' x0 estimates, until decoded
    cached: dict[str, tuple[bool, int, int]] = field(default_factory=dict)  # (step cached, rows skipped, computed)
    finished: list[RequestState] = field(default_factory=list)  # those that took their last step
    decoding: set[str] = field(default_factory=set)             # finished requests the decode stage took
    images: dict[str, list[Any]] = field(default_factory=dict)
    previews: dict[str, list[Any]] = field(default_factory=dict)
    preview_steps: dict[str, int] = field(default_factory=dict)
    encoded: Any = None                                         # the encode stage's collected texts
    loras_read: list[str] = field(default_factory=list)         # adapter reads ended since the last step
    loras_dropped: list[str] = field(default_factory=list)      # adapters the host cache let go

    def live(self, items: list[Any], key: Callable[[Any], str]) -> list[Any]:
        """Those of `items` whose request has not failed."""
        return [item for item in items if key(item) not in self.errors]

    def output(self, stage_processes: list[dict]) -> RunnerOutput:
        encoded, cached = self.encoded, {k: v for k, v in self.cached.items() if k not in self.errors}
        return RunnerOutput(images=self.images, errors=self.errors, previews=self.previews,
                            preview_steps=self.preview_steps,
                            encoded=encoded.ready if encoded else [], encode_errors=encoded.errors if encoded else {},
                            decoding_ids=sorted(self.decoding),
                            failed_lora_slots=[slot for slot, _ in self.failed_loras.values()],
                            loras_read=self.loras_read, loras_dropped=self.loras_dropped,
                            cached_ids=[k for k, (step_cached, _, _) in cached.items() if step_cached],
                            cache_rows=(sum(v[1] for v in cached.values()), sum(v[2] for v in cached.values())),
                            stages=self.stats, stage_processes=stage_processes)


_NO_PHASE = nullcontext()  # (stateless: entered by every stage while the profiler is off)


def _request_id(item: Any) -> str:
    return item.request_id


@dataclass(frozen=True)
class Stage:
    """One stage of the iteration: the runner's method `run`, as `run(work)`, or, with `items`,
    `run(work, requests)` under the retry. (A name, looked up at each step: the list is made once, and a test
    may replace one method of a runner.)"""

    name: str                                     # what a request's error says failed ("decode failed: ...")
    run: str
    items: Callable[[StepWork], list[Any]] | None = None  # the requests it runs on (None: once, on the step)
    alone: bool = False                           # each request on its own (one pool write each)
    # what puts the requests back as they were before a failed run of several (per_request's checkpoint)
    checkpoint: Callable[[list[Any]], Callable[[], None]] | None = None
    phase: str | None = None                      # the profiler's phase (--profile-steps) it counts under
    timed: str | None = None                      # the stage metrics' stage (stage_stats.STAGES) it is busy time of


def run_stages(owner: Any, stages: tuple[Stage, ...], work: StepWork, timer: PhaseTimer) -> None:
    """Runs `stages` (methods of `owner`) in order. Every step runs them: no context manager is entered per stage
    unless the profiler is on (a clock read is what the stage metrics take)."""
    for stage in stages:
        items = None if stage.items is None else work.live(stage.items(work), _request_id)
        if items == []:  # a stage of requests, none of them live: not run, not timed
            continue
        run = getattr(owner, stage.run)
        start = time.perf_counter()
        with timer.phase(stage.phase) if stage.phase and timer.enabled else _NO_PHASE:
            if items is None:
                run(work)
            else:
                for group in [[item] for item in items] if stage.alone else [items]:
                    per_request(group, lambda g: run(work, g), work.errors, stage.name, key=_request_id,
                                checkpoint=stage.checkpoint)
        if stage.timed:
            work.stats.add(stage.timed, time.perf_counter() - start, 0)
