"""Async scheduling: with the in-process worker, each step runs on a thread of its own ("dvllm-worker") while the
driver schedules the next one. The images are the synchronous engine's; a failed step fails its request alone,
once, a step later; a request admitted while the step that was to write its prompt embedding (or load its
adapter) fails, fails too, never denoising from unwritten memory; an abort while its step is in flight ends the
request once; preemption works on requests with steps in flight; shutdown joins the thread."""
from __future__ import annotations

import argparse
import threading

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.config_flags import add_engine_args, engine_kwargs

WORKER = "dvllm-worker"
WAIT = 30  # how long a test waits on an event before it fails (never reached when things work)


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


REQUESTS = {
    "a": ("a red circle", P(seed=1, num_inference_steps=4, guidance_scale=6.5)),  # 6.5: the failure test's target
    "b": ("a blue square", P(seed=2, guidance_scale=1.0, num_inference_steps=2)),
    "c": ("a green star", P(seed=3, negative_prompt="blurry")),
    "d": ("a yellow moon", P(seed=4, height=32, width=32, num_inference_steps=4)),
    "e": ("a red circle", P(seed=5, n=2, guidance_scale=7.5)),
    "f": ("a black dot", P(seed=6, height=32, width=32, num_inference_steps=2, guidance_scale=3.0)),
    "g": ("a purple star", P(seed=8)),
    "low": ("a slow circle", P(seed=4, guidance_scale=1.0, num_inference_steps=6, priority=5)),
    "low2": ("a short circle", P(seed=9, guidance_scale=1.0, num_inference_steps=2, priority=5)),
    "urgent": ("an urgent square", P(seed=5, guidance_scale=1.0, num_inference_steps=2, n=2, priority=-5)),
}
WORKLOAD = {0: ["a", "b"], 1: ["c", "d"], 3: ["e", "f"]}  # driver step -> requests added just before it


class _Engines:
    """Makes engines on the tiny model and shuts them down after the test."""

    def __init__(self, path: str) -> None:
        self.path, self.made = path, []

    def __call__(self, **kwargs) -> DiffusionEngine:
        kwargs.setdefault("decode_stage", False)
        engine = DiffusionEngine(model=self.path, device="cpu", dtype="float32", max_image_pixels=64 * 64, **kwargs)
        self.made.append(engine)
        return engine


@pytest.fixture
def make(sd_eps_path):
    engines = _Engines(sd_eps_path)
    yield engines
    for engine in engines.made:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(sd_eps_path) -> dict[str, list]:
    """Every request's images from the synchronous engine."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_image_pixels=64 * 64,
                             decode_stage=False)
    names = list(REQUESTS)
    outs = engine.generate([REQUESTS[n][0] for n in names], [REQUESTS[n][1] for n in names], use_tqdm=False)
    engine.shutdown()
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return {name: out.images for name, out in zip(names, outs)}


def _collect(outputs: dict[str, list], step_outputs) -> None:
    for out in step_outputs:
        outputs.setdefault(out.request_id, []).append(out)


def _drain(engine: DiffusionEngine, outputs: dict[str, list] | None = None) -> dict[str, list]:
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished_requests():
        _collect(outputs, engine.step())
    return outputs


def _run(engine: DiffusionEngine, workload=WORKLOAD) -> dict[str, list]:
    """Every output of each request, the requests added before the driver steps `workload` names."""
    outputs: dict[str, list] = {}
    step = 0
    while step <= max(workload) or engine.has_unfinished_requests():
        for name in workload.get(step, []):
            engine.add_request(name, *REQUESTS[name])
        _collect(outputs, engine.step())
        step += 1
    return outputs


def _spy_execute(engine: DiffusionEngine, monkeypatch, before=None) -> dict[str, list]:
    """Records (iteration, thread) of every worker step as it starts, and the iteration as it ends;
    `before(scheduler_output)` runs first (to block one)."""
    worker, log = engine.executor.worker, {"start": [], "end": []}
    real = worker.execute

    def execute(scheduler_output):
        log["start"].append((scheduler_output.iteration, threading.current_thread()))
        if before is not None:
            before(scheduler_output)
        try:
            return real(scheduler_output)
        finally:
            log["end"].append(scheduler_output.iteration)

    monkeypatch.setattr(worker, "execute", execute)
    return log


def _blocking(iteration: int):
    """(entered, release, before): `before` for _spy_execute holds the worker in `iteration` until release."""
    entered, release = threading.Event(), threading.Event()

    def before(out):
        if out.iteration == iteration:
            entered.set()
            assert release.wait(WAIT)

    return entered, release, before


def _spy_schedule(engine: DiffusionEngine, monkeypatch, before=None, after=None) -> list:
    """Records every SchedulerOutput; `before()` runs before the scheduler does, `after(out)` after."""
    scheduler, outs = engine.scheduler, []
    real = scheduler.schedule

    def schedule(*args, **kwargs):
        if before is not None:
            before()
        out = real(*args, **kwargs)
        outs.append(out)
        if after is not None:
            after(out)
        return out

    monkeypatch.setattr(scheduler, "schedule", schedule)
    return outs


def _assert_images(outputs: dict[str, list], reference: dict[str, list], names) -> None:
    for name in names:
        final = outputs[name][-1]
        assert final.finished and final.error is None, (name, final.error)
        assert sum(o.finished for o in outputs[name]) == 1, name
        assert len(final.images) == len(reference[name])
        for got, want in zip(final.images, reference[name]):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _the_only_final(outputs: list):
    """The request's one finished output, which is its last."""
    assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished
    return outputs[-1]


@pytest.mark.parametrize("stages", [False, True], ids=["in-loop", "decode-and-encode-stages"])
def test_a_mixed_workload_gives_the_synchronous_engines_images(make, reference, monkeypatch, stages):
    engine = make(async_scheduling=True, decode_stage=stages, encode_stage=stages)
    scheduled = _spy_schedule(engine, monkeypatch)
    outputs = _run(engine)
    names = [n for group in WORKLOAD.values() for n in group]
    _assert_images(outputs, reference, names)
    for name in names:  # every step taken once, in order; one progress output per step, none twice
        steps = [i for out in scheduled for rid, i in zip(out.scheduled_ids, out.step_indices) if rid == name]
        num_steps = outputs[name][-1].num_inference_steps
        assert steps == list(range(num_steps)), name
        assert [o.num_steps_done for o in outputs[name]] == list(range(1, num_steps + 1)), name
    assert engine.executor.worker.runner.states == {}
    if stages:  # the stages did their part beside the worker's thread
        items = engine.stats()["stage_items"]
        assert items["encode_stage"] > 0 and items["decode_stage"] > 0, items


def test_the_next_step_is_scheduled_while_the_worker_runs_the_current_one(make, reference, monkeypatch):
    engine = make(async_scheduling=True)
    started, release, block_second = _blocking(2)
    seen = []
    log = _spy_execute(engine, monkeypatch, block_second)

    def before():
        if engine.scheduler.iteration == 2:  # about to schedule iteration 3: the worker is inside iteration 2
            assert started.wait(WAIT)

    def after(out):
        if out.iteration == 3:
            seen.append((2 in log["end"], out.scheduled_ids, out.step_indices))
            release.set()

    _spy_schedule(engine, monkeypatch, before, after)
    engine.add_request("a", *REQUESTS["a"])
    try:
        outputs = _drain(engine)
    finally:
        release.set()
    # iteration 3 was scheduled while 2 ran, and took the request's third step: the one in flight was counted
    assert seen == [(False, ["a"], [2])]
    _assert_images(outputs, reference, ["a"])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_worker_steps_on_its_own_thread_only_with_async_scheduling(make, monkeypatch, async_scheduling):
    engine = make(async_scheduling=async_scheduling)
    log = _spy_execute(engine, monkeypatch)
    engine.add_request("b", *REQUESTS["b"])
    assert _the_only_final(_drain(engine)["b"]).error is None
    names = {thread.name for _, thread in log["start"]}
    assert log["start"] and names == ({WORKER} if async_scheduling else {threading.current_thread().name})


def test_a_failed_step_fails_its_request_once_a_step_later_and_no_other(make, reference, monkeypatch):
    engine = make(async_scheduling=True)
    adapter = engine.executor.worker.runner.adapter
    real = adapter.denoise

    def denoise(latents, timesteps, conditions, guidance, layout):
        if bool((guidance == 6.5).any()):  # request "a", from its first step on
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(latents, timesteps, conditions, guidance, layout)

    monkeypatch.setattr(adapter, "denoise", denoise)
    scheduled = _spy_schedule(engine, monkeypatch)
    outputs = _run(engine)
    final = _the_only_final(outputs["a"])
    assert len(outputs["a"]) == 1 and final.images == []
    assert final.error.startswith("denoise failed: RuntimeError: CUDA error")
    # its next step was scheduled before its failure came back (the worker skipped it), and none after that
    assert [out.step_indices[out.scheduled_ids.index("a")] for out in scheduled if "a" in out.scheduled_ids] \
        == [0, 1]
    _assert_images(outputs, reference, ["b", "c", "d", "e", "f"])
    assert engine.executor.worker.runner.states == {}


def test_a_request_reading_a_prompt_embedding_whose_write_failed_in_flight_fails(make, reference, monkeypatch):
    engine = make(async_scheduling=True)
    adapter = engine.executor.worker.runner.adapter
    real, failing = adapter.encode_prompt, [True]

    def encode(texts, **kwargs):
        if failing[0] and any(text == "a purple star" for text, _ in texts):
            raise RuntimeError("text encoder out of memory")
        return real(texts, **kwargs)

    monkeypatch.setattr(adapter, "encode_prompt", encode)
    prompt = REQUESTS["g"][0]
    engine.add_request("A", prompt, P(seed=7))
    outputs: dict[str, list] = {}
    _collect(outputs, engine.step())  # A admitted: its step (and its encode) in flight
    assert "A" not in outputs  # its update has not come back: B reads the entry A is to write
    engine.add_request("B", prompt, P(seed=8))
    _drain(engine, outputs)
    assert _the_only_final(outputs["A"]).error == "prompt encoding failed: RuntimeError: text encoder out of memory"
    b = _the_only_final(outputs["B"])
    assert b.images == [] and "prompt embedding could not be written" in b.error, b.error
    # the entry left unwritten is not served: the prompt is encoded afresh for the next request, and exact
    failing[0] = False
    engine.add_request("g", *REQUESTS["g"])
    _assert_images(_drain(engine), reference, ["g"])
    assert engine.executor.worker.runner.states == {}


def test_a_request_admitted_while_its_adapters_load_fails_in_flight_fails_with_that_error(make, tmp_path,
                                                                                         monkeypatch):
    from conftest import tiny_sd_pipeline
    from lora_utils import fail_first_load, make_lora

    folder = make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=5)
    engine = make(async_scheduling=True, enable_lora=True)
    engine.load_lora("style", folder)
    calls = fail_first_load(engine.executor.worker.runner.lora, monkeypatch)
    # no CFG: B shares no prompt-cache entry with A, only the adapter
    styled = P(seed=1, guidance_scale=1.0, loras={"style": 1.0})
    engine.add_request("A", "a red circle", styled)
    outputs: dict[str, list] = {}
    _collect(outputs, engine.step())  # A's adapter is loading (and failing) in flight
    assert "A" not in outputs
    engine.add_request("B", "a blue square", P(seed=2, guidance_scale=1.0, loras={"style": 1.0}))
    _drain(engine, outputs)
    error = _the_only_final(outputs["A"]).error
    assert "could not be loaded" in error and "simulated" in error, error
    assert _the_only_final(outputs["B"]).error == error
    assert calls == ["style"]  # B took the slot A's load was to fill
    engine.add_request("C", "a red circle", styled)  # the slot is free again and loads
    assert _the_only_final(_drain(engine)["C"]).error is None
    assert calls == ["style", "style"]


def test_an_abort_while_its_step_is_in_flight_ends_the_request_once(make, reference, monkeypatch):
    engine = make(async_scheduling=True)
    entered, release, block_second = _blocking(2)
    _spy_execute(engine, monkeypatch, block_second)
    for name in ("a", "b", "c"):
        engine.add_request(name, *REQUESTS[name])
    outputs: dict[str, list] = {}
    try:
        _collect(outputs, engine.step())
        _collect(outputs, engine.step())  # returns iteration 1's update; iteration 2 is on the worker
        assert entered.wait(WAIT)
        assert engine.abort_request("b")  # its last step is in flight
        assert engine.abort_request("c")  # mid-way
    finally:
        release.set()
    _drain(engine, outputs)
    for name in ("b", "c"):
        final = _the_only_final(outputs[name])
        assert (final.error, final.images) == ("request aborted", [])
        assert all(o.error is None for o in outputs[name][:-1])
    assert not engine.abort_request("b")
    _assert_images(outputs, reference, ["a"])
    assert engine.executor.worker.runner.states == {}


@pytest.mark.parametrize("low, preemptions", [("low", 1), ("low2", 0)], ids=["mid-run", "last-step-in-flight"])
def test_priority_preemption_of_a_request_with_steps_in_flight(make, reference, low, preemptions):
    """The urgent request needs both rows: the low one goes, unless its last step is in flight (it is leaving)."""
    engine = make(async_scheduling=True, scheduling_policy="priority", max_batch_size=2)
    engine.add_request(low, *REQUESTS[low])
    outputs: dict[str, list] = {}
    for _ in range(2):  # the low request's first two steps in flight
        _collect(outputs, engine.step())
    engine.add_request("urgent", *REQUESTS["urgent"])
    _drain(engine, outputs)
    assert engine.stats()["num_preemptions"] == preemptions
    _assert_images(outputs, reference, [low, "urgent"])
    num_steps = REQUESTS[low][1].num_inference_steps
    assert [o.num_steps_done for o in outputs[low]] == list(range(1, num_steps + 1))  # none lost or taken twice
    assert engine.executor.worker.runner.states == {}


def test_shutdown_with_steps_in_flight_joins_the_worker_thread(make, monkeypatch):
    engine = make(async_scheduling=True)
    entered, release, block_second = _blocking(2)
    log = _spy_execute(engine, monkeypatch, block_second)
    engine.add_request("a", *REQUESTS["a"])
    errors: list[BaseException] = []

    def close() -> None:
        try:
            engine.shutdown()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    closer = threading.Thread(target=close, name="closer")
    try:
        engine.step()
        engine.step()
        assert entered.wait(WAIT)
        make.made.remove(engine)  # shut down here, not again by the fixture
        closer.start()
    finally:
        release.set()
    assert closer.ident is not None
    closer.join(WAIT)
    assert not closer.is_alive() and errors == []
    (worker_thread,) = {thread for _, thread in log["start"]}
    assert worker_thread.name == WORKER and not worker_thread.is_alive()


def test_async_scheduling_is_off_by_default_and_a_cli_flag():
    assert EngineConfig(model="tiny-shapes").async_scheduling is False
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs(parser.parse_args([]))["async_scheduling"] is False


@pytest.mark.slow
def test_an_id_reused_at_once_after_an_abort_in_flight_is_a_new_request(make, reference, monkeypatch):
    """The old request's step in flight reports on its id after the new one took it: that report (here a
    failure) belongs to the old request, not to the new one, which takes all of its own steps."""
    engine = make(async_scheduling=True)
    adapter = engine.executor.worker.runner.adapter
    real = adapter.denoise

    def denoise(latents, timesteps, conditions, guidance, layout):
        if bool((guidance == 6.5).any()):  # the old request only
            raise RuntimeError("boom")
        return real(latents, timesteps, conditions, guidance, layout)

    monkeypatch.setattr(adapter, "denoise", denoise)
    engine.add_request("x", *REQUESTS["a"])  # guidance 6.5: its first step fails on the worker
    outputs: dict[str, list] = {}
    _collect(outputs, engine.step())  # in flight, its failure not yet heard of
    assert engine.abort_request("x")
    engine.add_request("x", *REQUESTS["c"])
    _drain(engine, outputs)
    aborted, *new = outputs["x"]
    assert (aborted.error, aborted.finished) == ("request aborted", True)
    assert [o.num_steps_done for o in new] == list(range(1, 4))
    _assert_images({"c": new}, reference, ["c"])
