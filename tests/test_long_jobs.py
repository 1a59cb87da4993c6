"""Long jobs on the tiny Wan: a running video's abort frees its rows and blocks at the next step while the others
finish as they would alone, and progress outputs carry the step and an ETA from the request's measured step times.
Nothing here waits on the clock: the engine is stepped by hand, and the ETA's values are never asserted, only its
presence, sign and end."""
from __future__ import annotations

import math

import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.core.step_pace import StepPace

LATENT_TOL = 1e-4  # tests/test_wan.py's: a video batched beside others against the same video alone


def P(**kw) -> SamplingParams:
    return SamplingParams(**{"height": 16, "width": 16, "num_frames": 5, "guidance_scale": 4.0,
                             "output_type": "latent", **kw})


@pytest.fixture(scope="module")
def engine(wan_path):
    return DiffusionEngine(model=wan_path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def async_engine(wan_path):
    """Async scheduling: a step is scheduled while the one before runs, so one may be in flight at the abort."""
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", async_scheduling=True)
    yield engine
    engine.shutdown()


def spy_steps(engine: DiffusionEngine, monkeypatch) -> list:
    """Every SchedulerOutput the engine sends its worker from now on, in order."""
    sent = []
    for name in ("execute", "execute_ahead"):
        real = getattr(engine.executor, name)

        def spy(index, sched_out, _real=real):
            sent.append(sched_out)
            return _real(index, sched_out)
        monkeypatch.setattr(engine.executor, name, spy)
    return sent


def finals(engine: DiffusionEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


@pytest.mark.parametrize("ahead", [False, True], ids=["in step", "async scheduling"])
def test_an_aborted_running_video_leaves_the_next_step_and_the_pool(request, monkeypatch, ahead):
    engine = request.getfixturevalue("async_engine" if ahead else "engine")
    keep, other = P(num_inference_steps=6, seed=1), P(num_inference_steps=5, seed=3, guidance_scale=1.0)
    alone = engine.generate(["a wave", "a cloud"], [keep, other], use_tqdm=False)
    steps_sent = spy_steps(engine, monkeypatch)
    engine.add_request("keep", "a wave", keep)
    engine.add_request("drop", "a long storm", P(num_inference_steps=300, seed=2))
    engine.add_request("other", "a cloud", other)
    scheduler, runner = engine.scheduler, engine.executor.worker.runner
    while len(steps_sent) < 3:
        engine.step()
    assert set(steps_sent[-1].scheduled_ids) == {"keep", "drop", "other"}
    dropped = scheduler.requests["drop"]
    rows, held, used = dropped.rows, dropped.private_blocks, scheduler.blocks.num_used_blocks
    free = scheduler.blocks.num_free
    assert held > 0

    assert engine.abort_request("drop")
    # its own blocks are back in the pool at once (its texts' entries stay cached, for others or reclaimed)
    assert scheduler.blocks.num_free == free + held and scheduler.blocks.num_used_blocks <= used - held
    aborted_at, rows_before = len(steps_sent), steps_sent[-1].num_rows
    outs = engine.step()
    step = steps_sent[aborted_at]  # the first step scheduled after the abort
    assert "drop" not in step.scheduled_ids and "drop" in step.freed_ids
    assert step.num_rows == rows_before - rows
    aborted = [o for o in outs if o.request_id == "drop"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].error == "request aborted"
    if not ahead:  # (with a step in flight, the worker runs the step that drops it after this one)
        assert "drop" not in runner.states  # the worker dropped its state in that same step

    done = finals(engine)
    assert "drop" not in runner.states
    assert all("drop" not in s.scheduled_ids for s in steps_sent[aborted_at:])
    assert set(done) == {"keep", "other"}
    for want, request_id in zip(alone, ("keep", "other")):
        got = done[request_id]
        assert got.error is None, got.error
        assert float((got.images[0] - want.images[0]).abs().max()) <= LATENT_TOL, request_id
    assert scheduler.blocks.num_used_blocks == 0 and runner.states == {}


def test_progress_carries_the_step_and_an_eta_that_ends_at_zero(engine):
    engine.add_request("a", "a slow pan", P(num_inference_steps=5, seed=4, output_kind="progress"))
    engine.add_request("b", "a fast pan", P(num_inference_steps=3, seed=5, output_kind="progress"))
    seen: dict[str, list] = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    for request_id, outs in seen.items():
        steps = [o.num_steps_done for o in outs]
        assert steps == sorted(steps) and steps[-1] == outs[-1].num_inference_steps, (request_id, steps)
        assert all(o.num_inference_steps == outs[0].num_inference_steps for o in outs)
        for out in outs[:-1]:  # every progress output comes after a step: the ETA is measured
            assert out.num_steps_done >= 1 and out.eta_s is not None
            assert math.isfinite(out.eta_s) and out.eta_s >= 0
        assert outs[-1].finished and outs[-1].eta_s == 0.0


def test_the_pace_is_the_mean_of_the_recent_steps_times_the_steps_left():
    pace = StepPace()
    assert pace.eta(4) is None  # nothing measured yet
    pace.start(10.0)
    pace.start(99.0)  # a later scheduling does not move the first step's start
    pace.record(11.0)
    pace.record(14.0)
    assert pace.eta(3) == 3 * (1.0 + 3.0) / 2
    assert pace.eta(0) == 0.0
    for t in range(15, 15 + 20):  # the window forgets the slow steps
        pace.record(float(t))
    assert pace.eta(2) == 2.0
    pace.reset()
    assert pace.eta(2) is None
