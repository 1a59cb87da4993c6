"""The engine core: one worker's step is schedule -> execute -> update, and the in-process engine steps its
one core with none of data parallelism's placement, rebalancing, restarts or heartbeats in the way."""
from __future__ import annotations

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.engine.coordinator import Coordinator


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


@pytest.fixture(scope="module")
def engine(sd_eps_path) -> DiffusionEngine:
    return DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")


def test_one_core_steps_a_request_to_its_images(engine):
    core = engine.coordinator.single
    assert core is engine.coordinator.cores[0] and core.scheduler is engine.scheduler
    engine.add_request("a", "a red circle", P(seed=1))
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs += core.step()
    assert [o.num_steps_done for o in outputs if o.request_id == "a"][-1] == 3
    assert outputs[-1].ok and outputs[-1].images[0].shape == (16, 16, 3)
    assert core.last_step[1] in (0, 1) and core.steps >= 3 and core.rows >= 3 * 2


def test_an_idle_core_costs_the_worker_nothing(engine, monkeypatch):
    calls = []
    worker = engine.executor.worker
    real = worker.execute
    monkeypatch.setattr(worker, "execute", lambda out: calls.append(out) or real(out))
    core = engine.coordinator.single
    steps = core.steps
    assert core.step() == [] and calls == [] and core.steps == steps


def test_the_in_process_engine_runs_no_data_parallel_logic(engine, monkeypatch):
    """Balancing, restarts, heartbeats and the executor's submit/wait split are for several workers: with the
    in-process one, a step that reached them would fail here. The images are those of a plain run."""
    reference = [o.images[0] for o in engine.generate(["a blue square", "a green star"], P(seed=2), use_tqdm=False)]

    def forbidden(*args, **kwargs):
        raise AssertionError("the single core's step ran data-parallel logic")

    for name in ("rebalance", "tend", "heartbeat", "on_death"):
        monkeypatch.setattr(Coordinator, name, forbidden)
    monkeypatch.setattr(engine.executor, "wait", forbidden)
    core = engine.coordinator.single
    rows = core.rows
    outputs = engine.generate(["a blue square", "a green star"], P(seed=2), use_tqdm=False)
    assert all(o.ok for o in outputs) and core.rows - rows == 2 * 3 * 2  # two CFG requests, three steps each
    for out, image in zip(outputs, reference):
        np.testing.assert_array_equal(out.images[0], image)
