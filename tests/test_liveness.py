"""Liveness (issue 47): a process that lives but answers nothing is seen, not only a dead one. A stopped (SIGSTOP)
encode or decode worker passes its call's bound, is killed and started again, and its batch redone: the request
gets the image a normal run gives. A stopped engine core turns /health to 503 naming it and its age, new requests
are refused with 503, and once it runs again (SIGCONT) both come back. /health and /metrics carry the heartbeats.

The tests wait on what the server reports, never on the clock; their time bounds are reached only when something
is broken. One server (its core in a process of its own, one encode and one decode worker) serves the module.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from utils_server import FAST, WAIT, png_pixels, wait_until

from dvllm import AsyncDiffusionEngine, EngineConfig
from dvllm.config_flags import add_engine_args, engine_kwargs
from dvllm.engine.async_engine import EngineUnresponsiveError
from dvllm.engine.start_checks import check_at_start
from dvllm.entrypoints.api_server import build_app
from dvllm.runtime.liveness import CallBounds
from dvllm.worker.encode_worker import EncodeWorker
from dvllm.worker.stage_process import WorkerProcessLost

CALL_S = 5.0  # a stage call's bound here: the tiny model's batches take milliseconds, even on a loaded machine
CORE_S = 5.0  # the core's heartbeat bound: its steps take milliseconds too
BODY = {"prompt": "a red circle", "seed": 7, **FAST}


# -- config and flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["stage_call_timeout_s", "stage_start_timeout_s", "core_heartbeat_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "5", True])
def test_a_bound_that_is_no_finite_positive_number_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):  # the core's bound by EngineConfig, the stages' by StageConfig
        check_at_start(EngineConfig(**{name: value}))


def test_the_bounds_are_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--stage-call-timeout-s", "7", "--stage-start-timeout-s", "70",
                              "--core-heartbeat-timeout-s", "9.5"])
    kwargs = engine_kwargs(args)
    assert (kwargs["stage_call_timeout_s"], kwargs["stage_start_timeout_s"], kwargs["core_heartbeat_timeout_s"]) \
        == (7.0, 70.0, 9.5)
    defaults = EngineConfig()
    assert defaults.stage_call_timeout_s < defaults.stage_start_timeout_s


# -- /health and /metrics over a stub engine's heartbeats ----------------------------------------------

class _Engine:
    """What the server reads of an engine: its counters and heartbeats."""

    is_running = True
    loaded_model = type("Loaded", (), {"name": "tiny"})()

    def __init__(self, core_age: float, call_age: float | None) -> None:
        self.step_listeners: list = []
        self.process = {"worker": 0, "stage": "encode_stage", "index": 0, "pid": 42, "call_age_s": call_age,
                        "limit_s": 10.0, "restarts": 1, "timeouts": 1}
        self.core = {"pid": 41, "heartbeat_age_s": core_age, "limit_s": 60.0, "responsive": core_age <= 60.0,
                     "stalls": 2}
        self._stats = {"num_running": 0, "num_waiting": 0, "num_preemptions": 0, "pool_total_blocks": 8,
                       "pool_used_blocks": 0, "pool_cached_blocks": 0, "prompt_cache_hits": 0,
                       "prompt_cache_queries": 0, "cache_skipped_rows": 0, "cache_computed_rows": 0,
                       "lora_slot_loads": 0, "loras_resident": 0, "num_workers": 1, "num_workers_alive": 1,
                       "stage_restarts": {"encode_stage.process": 1}, "stage_timeouts": {"encode_stage.process": 1},
                       "workers": [{"worker": 0, "alive": True, "rows_per_step": 0.0, "steps_per_s": 0.0,
                                    "pool_used_blocks": 0, "restarts": 0, "stage_processes": [self.process]}]}

    def stats(self) -> dict:
        return self._stats

    def liveness(self) -> dict:
        return {"engine_core": self.core, "stage_processes": [self.process]}


@pytest.mark.parametrize("core_age, call_age, status", [(0.5, None, 200), (0.5, 12.0, 200), (61.0, None, 503),
                                                        (0.5, 21.0, 503)],
                         ids=["idle", "busy", "core-unresponsive", "stage-stuck"])
def test_health_tells_the_heartbeats_and_503s_past_their_bounds(core_age, call_age, status):
    engine = _Engine(core_age, call_age)
    client = TestClient(build_app(engine, argparse.Namespace()))  # no lifespan: the stub has no loop to start
    r = client.get("/health")
    body = r.json()
    assert r.status_code == status, body
    assert body["engine_core"] == engine.core and body["stage_processes"] == [engine.process]
    if status == 200:
        assert body["status"] == "ok"
    elif core_age > 60:
        assert "engine core (pid 41)" in body["error"]["message"] and "61.0 s" in body["error"]["message"]
    else:  # a call past twice its bound: the watchdog's kill, at the bound, did not take
        assert "encode_stage process 0 of worker 0 (pid 42)" in body["error"]["message"]
    text = client.get("/metrics").text
    assert f"dvllm_engine_core_heartbeat_age_seconds {float(core_age)}" in text
    assert "dvllm_engine_core_stalls_total 2.0" in text
    assert f'dvllm_stage_process_call_age_seconds{{index="0",stage="encode_stage",worker="0"}} {call_age or 0.0}' \
        in text
    assert 'dvllm_stage_timeouts_total{part="process",stage="encode_stage"} 1.0' in text


# -- a stage process's watchdog; a core on a thread ---------------------------------------------------------

@pytest.mark.slow
def test_a_call_blocked_sending_to_a_stopped_process_is_cut_at_its_bound():
    """A stopped process reads nothing, so a message larger than the pipe's buffer blocks its sender: the watchdog
    frees it by killing the process at the call's bound, and the process is started again."""
    process = EncodeWorker(lambda: b"x" * (16 << 20), "cpu", 1, 0)  # (its first message: the copy it builds from)
    process.bounds = CallBounds(call_s=1.0, start_s=1.0)
    first = process.pid
    try:
        with _stopped(first), pytest.raises(WorkerProcessLost, match="did not answer within 1 s"):
            process.call("a batch")
        assert (process.restarts, process.timeouts) == (1, 1) and process.pid != first
        assert process.health()["call_age_s"] is None
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(first, 0)
    finally:
        process.close()


def test_a_core_thread_wedged_in_a_step_is_unresponsive_until_it_goes_on(sd_eps_path):
    """The core on a thread of the server's process (engine_core_process off): a loop stuck inside a step (here a
    step listener that blocks it) answers no ping; new requests are refused until it goes on."""
    from test_async_engine import P, collect

    release, wedged = threading.Event(), threading.Event()

    def wedge(step, outputs) -> None:
        if not release.is_set():
            wedged.set()
            release.wait(WAIT)

    async def main() -> None:
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=16,
                                      core_heartbeat_timeout_s=1.0)
        engine.step_listeners.append(wedge)
        engine.start()
        running = asyncio.create_task(collect(engine, "a red circle", P(seed=1, num_inference_steps=3)))
        await _until(wedged.is_set, "the loop to wedge")  # (a first step may pass the bound on a loaded machine)
        await _until(lambda: not engine.liveness()["engine_core"]["responsive"], "the wedged loop to be seen")
        assert engine.liveness()["engine_core"]["pid"] == os.getpid()
        with pytest.raises(EngineUnresponsiveError, match="core_heartbeat_timeout_s=1"):
            await anext(engine.generate("a blue square", P(seed=2)))
        release.set()
        outs = await asyncio.wait_for(running, WAIT)
        assert outs[-1].finished and outs[-1].error is None  # accepted requests wait, and finish
        await _until(lambda: engine.liveness()["engine_core"]["responsive"], "the loop to answer again")
        assert engine.heartbeat.stalls >= 1
        await engine.shutdown(1)

    asyncio.run(main())


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# -- a real server: its core in a process, an encode and a decode worker ------------------------------------

@pytest.fixture(scope="module")
def client(sd_eps_path) -> Iterator[TestClient]:
    # No prompt cache: each request's texts go to the encode worker again
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32,
                                  max_image_pixels=4096, engine_core_process=True, encode_workers=1,
                                  decode_workers=1, enable_prompt_cache=False, stage_call_timeout_s=CALL_S,
                                  stage_start_timeout_s=WAIT, core_heartbeat_timeout_s=CORE_S)
    # (a request timeout: a request that would wait for ever, as on a server without these bounds, fails)
    with TestClient(build_app(engine, argparse.Namespace(request_timeout=WAIT))) as client:
        yield client


@pytest.fixture(scope="module")
def normal(client) -> np.ndarray:
    """The image of BODY on the server with nothing stopped (which starts the stage processes too)."""
    return _image(client)


def _image(client: TestClient) -> np.ndarray:
    r = client.post("/v1/images/generations", json=BODY)
    assert r.status_code == 200, r.text
    return png_pixels(r.json()["data"][0]["b64_json"])


def _health(client: TestClient) -> dict:
    return client.get("/health").json()


def _process(client: TestClient, stage: str) -> dict:
    (process,) = [p for p in _health(client)["stage_processes"] if p["stage"] == stage]
    return process


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The process stopped (it answers nothing and reads nothing) until the block ends, if it still lives then."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _metric(client: TestClient, line_start: str) -> float:
    (line,) = [line for line in client.get("/metrics").text.splitlines() if line.startswith(line_start + " ")]
    return float(line.split()[-1])


@pytest.mark.parametrize("stage", ["encode_stage", "decode_stage"])
@pytest.mark.slow
def test_a_stopped_stage_process_is_restarted_past_its_bound_and_the_image_is_the_normal_runs(client, normal,
                                                                                             stage):
    before = _process(client, stage)
    assert before["call_age_s"] is None and before["limit_s"] == CALL_S  # idle, warm: the call bound holds
    timeouts = f'dvllm_stage_timeouts_total{{part="process",stage="{stage}"}}'
    counted = _metric(client, timeouts)
    start = time.monotonic()
    with _stopped(before["pid"]):
        image = _image(client)  # (on today's main this request waits for ever)
    took = time.monotonic() - start
    np.testing.assert_array_equal(image, normal)
    assert took >= CALL_S  # it waited for the bound, then the batch was redone on a new process
    after = _process(client, stage)
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert after["timeouts"] == before["timeouts"] + 1
    with pytest.raises(ProcessLookupError):  # killed and reaped: no stopped process is left behind
        os.kill(before["pid"], 0)
    assert _metric(client, timeouts) == counted + 1
    assert _health(client)["status"] == "ok"


@pytest.mark.slow
def test_a_stopped_engine_core_turns_health_503_and_refuses_requests_until_it_runs_again(client, normal):
    core = _health(client)["engine_core"]
    assert core["responsive"] and core["limit_s"] == CORE_S and core["heartbeat_age_s"] < CORE_S
    assert core["pid"] != os.getpid()
    with _stopped(core["pid"]):
        wait_until(lambda: client.get("/health").status_code == 503, what="/health to see the stopped core")
        r = client.get("/health")
        body = r.json()
        assert r.status_code == 503 and body["error"]["code"] == "service_unavailable"
        assert f"engine core (pid {core['pid']})" in body["error"]["message"], body
        assert not body["engine_core"]["responsive"] and body["engine_core"]["heartbeat_age_s"] > CORE_S
        assert _metric(client, "dvllm_engine_core_heartbeat_age_seconds") > CORE_S
        refused = client.post("/v1/images/generations", json=BODY)
        assert refused.status_code == 503 and "not responding" in refused.json()["error"]["message"]
    wait_until(lambda: client.get("/health").status_code == 200, what="/health to see the core again")
    assert _metric(client, "dvllm_engine_core_stalls_total") >= 1
    np.testing.assert_array_equal(_image(client), normal)
