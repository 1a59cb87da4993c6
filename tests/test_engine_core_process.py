"""The async engine's core in a process of its own (engine_core_process): the same images as the core on a
thread, errors that cross the pipe as the caller's, a core that dies seen at once, and a clean shutdown.

The tests wait on what the engine reports (a streamed output, its stats), never on the clock; their time
bounds are reached only when something is broken.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from dvllm import AsyncDiffusionEngine, DiffusionEngine, QueueFullError
from dvllm.engine.async_engine import EngineDeadError, EngineShuttingDownError
from process_tree import dvllm_processes, zombie
from test_async_engine import ENDLESS, WAIT, P, collect  # the thread-mode tests' requests and stream reader


def core_engine(path: str, **kwargs) -> AsyncDiffusionEngine:
    return AsyncDiffusionEngine(model=path, device="cpu", dtype="float32", state_pool_mb=16,
                                engine_core_process=True, **kwargs)


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_streams_through_a_core_process_match_the_offline_engine(sd_eps_path):
    params = [P(seed=i, num_inference_steps=3 + i % 3, sampler=("ddim", "euler_a", "dpmpp_2m")[i % 3],
                num_previews=1 if i == 0 else 0) for i in range(5)]
    prompts = [f"prompt {i}" for i in range(5)]
    offline = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").generate(prompts, params,
                                                                                         use_tqdm=False)

    async def main():
        engine = core_engine(sd_eps_path)
        assert engine.core_process.pid != os.getpid() and not hasattr(engine, "engine")
        assert engine.stats()["num_workers_alive"] == 1  # counters from the start (/health reads them)
        engine.start()
        results = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))
        stats = engine.stats()
        await engine.shutdown(1)
        return results, stats, engine

    results, stats, engine = asyncio.run(main())
    for outs, want, sp in zip(results, offline, params):
        assert [o.num_steps_done for o in outs] == list(range(1, sp.num_inference_steps + 1))
        final = outs[-1]
        assert final.finished and final.error is None
        np.testing.assert_allclose(final.images[0], want.images[0], atol=1e-3, rtol=0)
    assert any(o.previews for o in results[0][:-1])  # previews crossed the pipe too
    assert stats["num_workers"] == 1 and stats["workers"][0]["alive"]  # the core's counters reach the server
    assert engine.core_process.returncode == 0  # shut down cleanly, not killed


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_prompts_arriving_during_a_batch_go_through_the_cores_encode_stage(sd_eps_path, async_scheduling):
    """With --encode-stage in the core process: requests that arrive while one runs are encoded on the stage's
    thread, and every stream's images are the offline engine's; with --async-scheduling too (the worker on its
    own thread in the core process, a step ahead of the scheduler)."""
    first = ("a long one", P(seed=9, num_inference_steps=30))
    later = [(f"later prompt {i}", P(seed=i, num_inference_steps=3)) for i in range(4)]
    offline = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").generate(
        [first[0]] + [p for p, _ in later], [first[1]] + [sp for _, sp in later], use_tqdm=False)

    async def main():
        engine = core_engine(sd_eps_path, encode_stage=True, async_scheduling=async_scheduling)
        engine.start()
        started = asyncio.Event()
        long_one = asyncio.create_task(collect(engine, *first, started=started))
        await asyncio.wait_for(started.wait(), WAIT)  # it runs: the later prompts meet a batch
        results = await asyncio.gather(long_one, *(collect(engine, p, sp) for p, sp in later))
        stats = engine.stats()
        await engine.shutdown(1)
        return results, stats

    results, stats = asyncio.run(main())
    for outs, want in zip(results, offline):
        assert outs[-1].finished and outs[-1].error is None
        np.testing.assert_allclose(outs[-1].images[0], want.images[0], atol=1e-3, rtol=0)
    assert stats["stage_items"]["encode_stage"] >= len(later)  # their prompts, on the stage's thread
    assert stats["num_encoding"] == 0


@pytest.mark.slow
def test_errors_cross_the_pipe_as_the_callers(sd_eps_path):
    async def main():
        engine = core_engine(sd_eps_path, max_num_waiting=1, max_batch_size=2, max_inference_steps=20_000)
        engine.start()
        with pytest.raises(ValueError, match="num_inference_steps"):  # checked in the server: never sent
            await collect(engine, "x", P(num_inference_steps=0))
        started = asyncio.Event()
        running = asyncio.create_task(collect(engine, "x", P(**ENDLESS), "endless", started))
        await asyncio.wait_for(started.wait(), WAIT)
        waiting = asyncio.create_task(collect(engine, "x", P(**ENDLESS), "waiting"))
        await until(lambda: engine.stats()["num_waiting"] == 1, "the second request to wait")
        with pytest.raises(QueueFullError):  # raised by the core's queue, pickled back
            await collect(engine, "x", P(), "third")
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "x", P(), "endless")
        running.cancel()
        waiting.cancel()
        await until(lambda: engine.stats()["num_running"] + engine.stats()["num_waiting"] == 0, "the aborts")
        await engine.shutdown(0)

    asyncio.run(main())


def test_a_killed_core_fails_its_requests_at_once_and_the_engine_reports_it(sd_eps_path):
    async def main():
        engine = core_engine(sd_eps_path, max_inference_steps=20_000)
        engine.start()
        started = asyncio.Event()
        running = asyncio.create_task(collect(engine, "x", P(**ENDLESS), started=started))
        await asyncio.wait_for(started.wait(), WAIT)
        assert engine.is_running
        os.kill(engine.core_process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code"):
            await asyncio.wait_for(running, WAIT)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, "x", P())
        await engine.shutdown(0)

    asyncio.run(main())


@pytest.mark.slow
def test_the_core_ignores_ctrl_c_and_drains_on_shutdown(sd_eps_path):
    """A terminal's SIGINT reaches the whole process group: the server drains, so the core must not die of it;
    a request running at shutdown finishes within the grace period."""
    async def main():
        engine = core_engine(sd_eps_path)
        engine.start()
        started = asyncio.Event()
        running = asyncio.create_task(collect(engine, "x", P(num_inference_steps=20, seed=1), started=started))
        await asyncio.wait_for(started.wait(), WAIT)
        os.kill(engine.core_process.pid, signal.SIGINT)
        await engine.shutdown(WAIT)
        outs = await running
        assert outs[-1].finished and outs[-1].error is None and len(outs) == 20
        with pytest.raises(EngineShuttingDownError):
            await collect(engine, "x", P())
        return engine

    assert asyncio.run(main()).core_process.returncode == 0


@pytest.mark.slow
def test_a_core_that_cannot_load_raises_at_construction(tmp_path):
    with pytest.raises(Exception, match="nowhere"):
        core_engine(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="engine_core_process"):
        DiffusionEngine(model=str(tmp_path), engine_core_process=True)


@pytest.mark.slow
def test_dvllm_serve_runs_its_core_apart_and_answers_503_when_it_dies(sd_eps_path):
    import httpx
    from utils_server import BASE_ARGS, FAST, RemoteServer, assert_error, metrics

    with RemoteServer(sd_eps_path, BASE_ARGS, fresh=True) as server:  # (its core is its descendant)
        assert metrics(server.url)["dvllm_num_requests_running"] == 0  # the core's counters from the start
        ok = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", **FAST}, timeout=WAIT)
        assert ok.status_code == 200, ok.text
        assert metrics(server.url)["dvllm_stage_items_total{stage=\"denoise\"}"] > 0  # the core's counters
        cores = dvllm_processes(server.proc.pid, "dvllm-core")
        assert len(cores) == 1, "dvllm serve runs one engine core process by default"
        os.kill(cores[0], signal.SIGKILL)
        deadline = time.monotonic() + WAIT
        while httpx.get(server.url + "/health", timeout=WAIT).status_code == 200:
            assert time.monotonic() < deadline, "/health never noticed the core's death"
            time.sleep(0.05)
        assert_error(httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", **FAST}, timeout=WAIT),
                     503)
        assert server.proc.poll() is None  # the server stays up to say so


@pytest.mark.slow
def test_a_server_killed_outright_takes_its_core_with_it(sd_eps_path):
    """No orphaned core holding a GPU: its end of the pipe closes with the server, and it leaves."""
    from utils_server import BASE_ARGS, RemoteServer

    with RemoteServer(sd_eps_path, BASE_ARGS, fresh=True) as server:  # (as a user starts it)
        (core,) = dvllm_processes(server.proc.pid, "dvllm-core")
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + WAIT
        while os.path.exists(f"/proc/{core}") and not zombie(core):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
