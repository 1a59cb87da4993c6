"""The scheduler's deadlines: reported under every policy; under the elastic group policy a request late at the
present pace (core/deadlines.py's Pace) steps alone ahead of the rest, until it is not."""
from __future__ import annotations

import time

import pytest
from scheduler_utils import Clock, iterate, make

from dvllm.core.deadlines import Pace
from dvllm.core.request import Request
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_output import RunnerOutput
from dvllm.core.stage_stats import StageStats


def _due_in(clock: Clock, rid: str, steps: int, deadline_s: float | None, arrived: float) -> Request:
    request = clock.request(rid, steps=steps)
    request.params.deadline_s, request.arrival_time = deadline_s, arrived
    return request


def test_the_elastic_policy_runs_a_late_request_ahead_until_it_is_not_late():
    s, c = make(group_policy="elastic", sequence_parallel_size=2), Clock()
    now = time.time()
    s.add_request(_due_in(c, "free", 12, None, now))
    s.add_request(_due_in(c, "late", 12, 60.0, now))  # 12 steps due in a minute
    s.add_request(_due_in(c, "relaxed", 12, 3600.0, now))
    s.add_request(_due_in(c, "hopeless", 12, 1.0, now - 10))  # already past due: no use running it first
    out, _ = iterate(s)
    assert len(out.scheduled_ids) == 4  # no step time measured yet: nobody is late
    s.pace.row_seconds = {(16, 16): 1.25}  # 8 rows: 10 s a step; 11 steps left: "late" would end ~110 s in
    alone = []
    while True:
        out, _ = iterate(s)
        if out.scheduled_ids != ["late"]:
            break
        alone.append(out.scheduled_ids)
    # alone while its steps left take more than the minute it has (11 down to 6 left), then with the rest again
    assert len(alone) == 6 and sorted(out.scheduled_ids) == ["free", "hopeless", "late", "relaxed"]
    assert s.stats()["late_steps"] == 6
    while s.has_unfinished_requests():
        iterate(s)
    assert (s.stats()["deadlines_met"], s.stats()["deadlines_missed"]) == (2, 1)  # late and relaxed; hopeless


def test_the_static_policy_only_reports_deadlines():
    s, c = make(), Clock()
    now = time.time()
    s.add_request(_due_in(c, "free", 4, None, now))
    s.add_request(_due_in(c, "late", 4, 60.0, now))
    assert s.pace is None  # no pace is kept: nobody steps ahead
    out, _ = iterate(s)
    assert sorted(out.scheduled_ids) == ["free", "late"]
    outputs = []
    while s.has_unfinished_requests():
        outputs += iterate(s)[1]
    met = {o.request_id: o.metrics.deadline_met for o in outputs if o.finished}
    assert met == {"free": None, "late": True}


def _small_behind_big() -> Scheduler:
    """An elastic scheduler with a 20-step 32x32 request and a 4-step 16x16 one due in 3 s. A step takes 0.2 s
    small and 2 s big: at the present pace the small's 4 steps take 8.8 s, alone 0.8 s."""
    s, c = make(group_policy="elastic", sequence_parallel_size=2), Clock()
    now = time.time()
    big = c.request("big", steps=20, size=32)
    big.arrival_time = now
    s.add_request(big)
    s.add_request(_due_in(c, "small", 4, 3.0, now))
    s.pace.row_seconds = {(16, 16): 0.1, (32, 32): 1.0}
    return s


def test_the_pace_counts_every_shapes_steps():
    """A small request behind a big one of another shape: at the present pace each of its steps waits for a
    big step too, so it is late; alone it is not."""
    s = _small_behind_big()
    picked = [iterate(s)[0].scheduled_ids for _ in range(4)]
    assert picked[0] == ["small"] and picked[1] == ["small"], picked  # first admitted, then ahead of big
    assert "big" in [rid for ids in picked for rid in ids]  # once its steps left fit the pace, turns again
    assert s.stats()["late_steps"] == 3


def test_a_request_its_decode_alone_would_make_miss_is_not_late():
    s = _small_behind_big()
    s.pace.decode_seconds_per_pixel = 2.5 / (16 * 16)  # 0.8 s of steps alone, then 2.5 s of decode: 3.3 s > 3 s
    for _ in range(4):
        iterate(s)
    assert s.stats()["late_steps"] == 0


def test_the_pace_is_measured_from_the_workers_outputs():
    pace, c = Pace(), Clock()
    request = c.request("a", steps=4, n=2, size=16)
    stages = StageStats()
    stages.add("decode_stage", 2.0, 2)
    stages.add("denoise", 0.8, 4)
    stages.add("encode", 0.5, 1)  # the step's encode (and an in-loop decode) is not the denoise's pace
    pace.measure([request], 4, RunnerOutput(images={"a": ["x", "y"]}, execute_seconds=1.5, stages=stages),
                 {"a": request})
    assert pace.row_seconds == {(16, 16): pytest.approx(0.2)}
    assert pace.decode_seconds_per_pixel == pytest.approx(2.0 / (2 * 16 * 16))
    stages = StageStats()
    stages.add("denoise", 0.4, 4)
    pace.measure([request], 4, RunnerOutput(execute_seconds=0.4, stages=stages), {"a": request})  # a moving average
    assert pace.row_seconds == {(16, 16): pytest.approx(0.15)}
