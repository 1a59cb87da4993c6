"""AsyncDiffusionEngine: streams, aborts, errors and shutdown, on a tiny model.

No test may depend on how fast the machine is: the tests wait on what the engine reports (a streamed
output, its stats, a step listener), never on the clock; their time bounds are only reached when
something is broken.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest

from dvllm import AsyncDiffusionEngine, DiffusionEngine, QueueFullError, SamplingParams
from dvllm.engine.async_engine import EngineShuttingDownError


def P(**kwargs) -> SamplingParams:
    return SamplingParams(**{**dict(num_inference_steps=4, guidance_scale=5.0, height=16, width=16,
                                    output_type="np"), **kwargs})


WAIT = 120.0  # s: bound on waiting for something the engine reports; reached only when it is broken
# A request that outlasts any test, however fast the machine: 20,000 steps are minutes at the ~10 ms a
# step takes here. Past 1000 steps DDIM refuses, so it uses euler; the engine needs max_inference_steps.
ENDLESS = {"num_inference_steps": 20_000, "sampler": "euler"}


def run(coro):
    return asyncio.run(coro)


async def collect(engine: AsyncDiffusionEngine, prompt: str, params: SamplingParams, request_id=None,
                  started: asyncio.Event | None = None):
    """The stream's outputs; sets `started` at the first one (the request was accepted and stepped)."""
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
        if started is not None:
            started.set()
    return outs


@pytest.mark.slow
def test_concurrent_streams_match_the_offline_engine(sd_eps_path):
    params = [P(seed=i, num_inference_steps=3 + i % 3, sampler=("ddim", "euler_a", "dpmpp_2m")[i % 3])
              for i in range(6)]
    prompts = [f"prompt {i}" for i in range(6)]
    offline = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").generate(prompts, params,
                                                                                         use_tqdm=False)

    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        engine.start()
        results = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))
        await engine.shutdown(1)
        return results

    for outs, want, sp in zip(run(main()), offline, params):
        steps = [o.num_steps_done for o in outs]
        assert steps == list(range(1, sp.num_inference_steps + 1))  # one progress output per step
        final = outs[-1]
        assert final.finished and final.error is None and not any(o.finished for o in outs[:-1])
        np.testing.assert_allclose(final.images[0], want.images[0], atol=1e-3, rtol=0)


def test_leaving_a_stream_aborts_the_request_and_frees_its_state(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        engine.start()
        stream = engine.generate("long", P(num_inference_steps=200, seed=1))
        first = await stream.__anext__()
        assert first.num_steps_done == 1
        await stream.aclose()  # the client went away
        await until(lambda: engine.stats()["num_running"] == 0 and engine.stats()["pool_used_blocks"] == 0)
        stats = engine.stats()
        await engine.shutdown(1)
        return stats, engine.engine.executor.worker.runner.states

    stats, states = run(main())
    assert stats["num_running"] == 0 and stats["pool_used_blocks"] == 0 and states == {}


def test_bad_input_and_full_queue_raise_before_anything_streams(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_num_waiting=1,
                                      max_batch_size=2, max_inference_steps=1000)
        engine.start()
        with pytest.raises(ValueError, match="num_inference_steps"):
            await collect(engine, "x", P(num_inference_steps=0))
        with pytest.raises(ValueError, match="prompt must be a string"):
            await collect(engine, 7, P())
        # one running (its 2 rows fill the batch), one waiting: the third finds the queue full
        first = asyncio.create_task(collect(engine, "r0", P(num_inference_steps=500, seed=0)))
        await until(lambda: engine.stats()["num_running"] == 1)
        second = asyncio.create_task(collect(engine, "r1", P(num_inference_steps=500, seed=1)))
        await until(lambda: engine.stats()["num_waiting"] == 1)
        with pytest.raises(QueueFullError):
            await collect(engine, "third", P())
        for task in (first, second):  # cancelling a stream aborts its request
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await until(lambda: engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0)
        await engine.shutdown(1)

    run(main())


async def until(condition, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)




def test_one_requests_failure_reaches_only_its_stream(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        adapter = engine.engine.executor.worker.runner.adapter
        real = adapter.encode_prompt

        def encode(texts):
            if any(t == "explode" for t, _ in texts):
                raise RuntimeError("text encoder failure")
            return real(texts)

        adapter.encode_prompt = encode
        engine.start()
        good, bad = await asyncio.gather(collect(engine, "fine", P(seed=1)), collect(engine, "explode", P(seed=2)))
        await engine.shutdown(1)
        return good, bad

    good, bad = run(main())
    assert good[-1].error is None and len(good[-1].images) == 1
    assert bad[-1].finished and "text encoder failure" in bad[-1].error


@pytest.mark.slow
def test_shutdown_lets_running_requests_finish_and_refuses_new_ones(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        engine.start()
        started = asyncio.Event()
        task = asyncio.create_task(collect(engine, "finishing", P(num_inference_steps=20, seed=3), started=started))
        await asyncio.wait_for(started.wait(), WAIT)  # accepted and stepped: running when the shutdown begins
        await engine.shutdown(grace_seconds=WAIT)  # returns as soon as the request is done: WAIT bounds a hang
        outs = await task
        with pytest.raises(EngineShuttingDownError):
            await collect(engine, "too late", P())
        return outs, engine.is_running

    outs, running = run(main())
    assert outs[-1].finished and outs[-1].error is None and not running


@pytest.mark.slow
def test_event_loop_stays_responsive_while_the_model_runs(sd_eps_path):
    """The steps run off the event loop: while they run, its timers fire on time. Were the loop blocked
    by a step, a 10 ms timer would fire only when that step ended, late by about a step; so the bound is
    relative to the step time measured here, whatever the machine's speed or load."""
    async def main():
        # 8 CFG requests of 64x64 fill the 16-row batch: steps of tens of ms or more, far above the
        # lateness of a timer on a loop that is free (about a millisecond, a GIL switch interval at worst).
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32",
                                      max_inference_steps=ENDLESS["num_inference_steps"], max_image_pixels=64 * 64)
        step_seconds: list[float] = []  # appended on the engine's loop thread
        engine.step_listeners.append(lambda stats, outputs: step_seconds.append(stats.seconds))
        engine.start()
        started = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(collect(engine, f"busy {i}", P(**ENDLESS, seed=i, height=64, width=64),
                                             started=event)) for i, event in enumerate(started)]
        # Each has had its first output: all 8 are running, and cannot finish while the test measures.
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), WAIT)
        first, lateness = len(step_seconds), []
        deadline = time.monotonic() + WAIT
        while len(lateness) < 20 or len(step_seconds) - first < 3:  # 20 ticks, spanning 3 steps at least
            assert time.monotonic() < deadline, f"the engine stopped stepping: {engine.stats()}"
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            lateness.append(time.perf_counter() - start - 0.01)
        busy = engine.stats()["num_running"]
        steps = step_seconds[first:]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.shutdown(1)
        return lateness, steps, busy

    lateness, steps, busy = run(main())
    assert busy == 8, "the engine must be working while we measure"
    late, step = statistics.median(lateness), statistics.median(steps)
    print(f"timer lateness: median {late * 1e3:.2f} ms, max {max(lateness) * 1e3:.1f} ms; "
          f"step: median {step * 1e3:.1f} ms over {len(steps)} steps")
    assert late < step / 4, (late, step)


def test_previews_are_spread_over_the_steps_and_converge(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        engine.start()
        outs = await collect(engine, "preview me", P(num_inference_steps=12, seed=4, num_previews=3))
        await engine.shutdown(1)
        return outs

    outs = run(main())
    with_previews = [o for o in outs if o.previews]
    # the steps the previews show (a decode stage may hand them out a step or more later)
    assert [o.preview_step for o in with_previews] == [3, 6, 9]
    assert all(o.num_steps_done >= o.preview_step for o in with_previews)
    final = outs[-1].images[0]
    errors = [float(np.abs(o.previews[0] - final).mean()) for o in with_previews]
    assert errors[-1] < errors[0]  # the x0 estimate approaches the final image
    assert all(o.previews[0].shape == final.shape for o in with_previews)


def test_a_stream_cancelled_before_acceptance_leaves_nothing_running(sd_eps_path):
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_inference_steps=1000)
        engine.start()
        task = asyncio.create_task(collect(engine, "cancelled early", P(num_inference_steps=500, seed=1)))
        await asyncio.sleep(0)  # the stream has sent its request and waits to hear it was accepted
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # The loop applies commands in the order they were sent: once a request sent after the cancel
        # has finished, whatever the cancelled stream sent (its request if it got that far, its abort)
        # has been applied.
        after = await collect(engine, "after the cancel", P(num_inference_steps=1, seed=2))
        assert after[-1].finished and after[-1].error is None
        await until(lambda: engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0)
        states = dict(engine.engine.executor.worker.runner.states)
        await engine.shutdown(1)
        return states

    assert run(main()) == {}


def test_a_request_processed_by_the_caller_is_not_processed_again(sd_eps_path, monkeypatch):
    """The video API checks a request before it answers; the engine then takes that processed request as it is
    (an upload decoded once) and makes the image it would have made from the parameters."""
    async def main():
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
        engine.start()
        plain = (await collect(engine, "a red circle", P(seed=3), "plain"))[-1]
        processed = engine.processor.process("checked", "a red circle", P(seed=3))
        calls = []
        process = engine.processor.process
        monkeypatch.setattr(engine.processor, "process", lambda *a, **k: calls.append(a) or process(*a, **k))
        outs = [out async for out in engine.generate("a red circle", None, "checked", processed=processed)]
        with pytest.raises(ValueError, match="processed is request 'checked', not 'other'"):
            await anext(engine.generate("a red circle", None, "other", processed=processed))
        await engine.shutdown(1)
        return plain, outs, calls

    plain, outs, calls = run(main())
    assert calls == [] and outs[-1].error is None
    np.testing.assert_array_equal(outs[-1].images[0], plain.images[0])
