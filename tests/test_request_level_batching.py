"""batching="request": the request-level policy other servers run by default, on dvllm's own kernels. What waits
when a batch ends is batched by equal shape and parameters (one LoRA set a batch, a step-cached request alone)
and runs to completion with nothing joining it; every image is the step-level engine's."""
from __future__ import annotations

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.core.scheduler import Scheduler

TOL = 1e-5  # batch compositions differ between the two policies; each row's arithmetic does not


def P(**kwargs) -> SamplingParams:
    return SamplingParams(**{"num_inference_steps": 3, "guidance_scale": 5.0, "height": 16, "width": 16,
                             "output_type": "np", **kwargs})


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> dict[str, str]:
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    return {"style": make_lora(tiny_sd_pipeline(), str(tmp_path_factory.mktemp("lora") / "style"), seed=5)}


def _run(path: str, adapter: dict[str, str], jobs: list[tuple[str, SamplingParams]], late: tuple | None = None,
         **options) -> tuple[dict[str, list[np.ndarray]], list[list[str]]]:
    """Every job's images, and the request ids of each step's forward. `late` arrives after the first step."""
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", lora_modules=adapter, **options)
    steps: list[list[str]] = []
    real_schedule = Scheduler.schedule

    def schedule(self):
        out = real_schedule(self)
        if out.scheduled_ids:
            steps.append(list(out.scheduled_ids))
        return out

    Scheduler.schedule = schedule
    try:
        for name, params in jobs:
            engine.add_request(name, name, params)
        images: dict[str, list[np.ndarray]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    images[out.request_id] = out.images
            if late is not None and steps:
                engine.add_request(late[0], late[0], late[1])
                late = None
    finally:
        Scheduler.schedule = real_schedule
        engine.shutdown()
    return images, steps


def test_batches_of_one_key_run_to_completion_and_give_the_step_engines_images(sd_eps_path, adapter):
    jobs = [("a1", P(seed=1)), ("b", P(seed=2, guidance_scale=7.0)),  # another guidance: another batch
            ("a2", P(seed=3)),  # a1's key: batched with it, though b arrived between them
            ("c1", P(seed=4, num_inference_steps=2, loras={"style": 0.5})),
            ("c2", P(seed=5, num_inference_steps=2, loras={"style": 0.5})),
            ("d", P(seed=6, num_inference_steps=2, loras={"style": 1.0})),  # another LoRA weight: its own batch
            ("e", P(seed=7, sampler="euler"))]
    late = ("a3", P(seed=8))  # a1's key, arriving while a1's batch runs: it waits for the next batch
    want, step_level = _run(sd_eps_path, adapter, jobs, late)
    got, request_level = _run(sd_eps_path, adapter, jobs, late, batching="request")
    assert request_level == [["a1", "a2"]] * 3 + [["b"]] * 3 + [["c1", "c2"]] * 2 + [["d"]] * 2 + [["e"]] * 3 + \
        [["a3"]] * 3
    assert len(step_level) < len(request_level)  # the step policy ran them together (the comparison's point)
    assert set(got) == set(want) == {name for name, _ in jobs} | {"a3"}
    for name in want:
        for a, b in zip(got[name], want[name]):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=name)


def test_a_step_cached_request_is_a_batch_of_its_own(flux_path):
    cache = {"method": "first_block", "threshold": 0.2}
    jobs = [("x1", P(seed=1, guidance_scale=3.5)), ("cached", P(seed=2, guidance_scale=3.5, cache=cache)),
            ("x2", P(seed=3, guidance_scale=3.5))]
    want, _ = _run(flux_path, {}, jobs)
    got, steps = _run(flux_path, {}, jobs, batching="request")
    assert steps == [["x1", "x2"]] * 3 + [["cached"]] * 3
    for name in want:
        np.testing.assert_allclose(got[name][0], want[name][0], atol=TOL, rtol=0, err_msg=name)


def test_priority_orders_the_batches_and_preempts_nothing(sd_eps_path):
    jobs = [("low", P(seed=1, priority=2)), ("other", P(seed=2, guidance_scale=7.0, priority=0)),
            ("urgent", P(seed=3, priority=-1))]
    _, steps = _run(sd_eps_path, {}, jobs, batching="request", scheduling_policy="priority", max_batch_size=2)
    # urgent first; low shares its key and has room (2 rows... CFG makes each request 2 rows: alone each)
    assert [s[0] for s in steps[::3]] == ["urgent", "other", "low"]


def test_batching_is_checked():
    from dvllm import EngineConfig
    from dvllm.core.scheduler_config import SchedulerConfig

    with pytest.raises(ValueError, match="batching must be one of"):
        SchedulerConfig.of(EngineConfig(batching="iteration"))
    with pytest.raises(ValueError, match="shape_order must be one of"):
        SchedulerConfig.of(EngineConfig(shape_order="newest"))
    with pytest.raises(ValueError, match="shape_order='oldest' with group_policy='elastic'"):
        SchedulerConfig.of(EngineConfig(shape_order="oldest", group_policy="elastic", sequence_parallel_size=2))
    with pytest.raises(ValueError, match="request-level policy's window: set batching='request'"):
        SchedulerConfig.of(EngineConfig(request_batch_wait_s=0.1))
    with pytest.raises(ValueError, match=r"request_batch_wait_s must be within \[0, 60\]"):
        SchedulerConfig.of(EngineConfig(batching="request", request_batch_wait_s=-1))


def test_a_batch_gathers_its_kind_for_the_window_while_the_engine_sleeps(sd_eps_path):
    """With a window longer than the test, the first request waits until one more of its kind fills the batch
    (max_batch_size: two CFG requests); one of another kind does not end the wait. No clock is read."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", batching="request",
                             request_batch_wait_s=60, max_batch_size=4)
    scheduler = engine.coordinator.cores[0].scheduler
    try:
        engine.add_request("first", "first", P(seed=1))
        engine.add_request("other", "other", P(seed=2, guidance_scale=7.0))
        for _ in range(3):
            assert engine.step() == [] and not scheduler.running and 0 < scheduler.hold_s <= 60
        engine.add_request("second", "second", P(seed=3))  # first's kind: the batch is full, it starts
        outputs, batches = {}, set()
        while len(outputs) < 2:
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
            batches |= {frozenset(r.request_id for r in scheduler.running)} - {frozenset()}
        assert batches == {frozenset({"first", "second"})}
        assert engine.step() == [] and 0 < scheduler.hold_s <= 60  # other gathers in its turn
        engine.add_request("other2", "other2", P(seed=4, guidance_scale=7.0))
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
            batches |= {frozenset(r.request_id for r in scheduler.running)} - {frozenset()}
    finally:
        engine.shutdown()
    assert batches == {frozenset({"first", "second"}), frozenset({"other", "other2"})}
    assert set(outputs) == {"first", "second", "other", "other2"} and all(o.error is None for o in outputs.values())
