"""The decode stage: finished latents and previews decode on a thread of the worker's, never in the denoise
loop; the images are the loop's own, a failure stays with its request, a dead thread loses nothing, an abort
while decoding ends the request once, and closing drains what was handed over."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker.decode_stage import DecodeJob, DecodeStage


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


REQUESTS = [("a red circle", P(seed=1)), ("a blue square", P(seed=2, n=2)), ("a green star", P(seed=3, height=32)),
            ("a yellow moon", P(seed=4, num_inference_steps=5, output_kind="progress", num_previews=2))]


def _engine(path: str, **kwargs) -> DiffusionEngine:
    kwargs.setdefault("decode_stage", True)
    return DiffusionEngine(model=path, device="cpu", dtype="float32", max_image_pixels=64 * 64, **kwargs)


def _run(engine: DiffusionEngine, requests=REQUESTS) -> dict[str, list]:
    """Every output of each request, in order, stepping the low-level loop."""
    outputs: dict[str, list] = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _stage(engine: DiffusionEngine) -> DecodeStage:
    return engine.executor.worker.runner.decode_stage


def _decode_spy(engine: DiffusionEngine, monkeypatch, before=None) -> list[str]:
    """Records the thread of every VAE decode; `before(latents, size)` runs first (to fail or block one)."""
    adapter, threads = engine.executor.worker.runner.adapter, []
    real = adapter.decode

    def decode(latents, size):
        threads.append(threading.current_thread().name)
        if before is not None:
            before(latents, size)
        return real(latents, size)

    monkeypatch.setattr(adapter, "decode", decode)
    return threads


@pytest.fixture(scope="module")
def in_loop(sd_eps_path) -> dict[str, list]:
    return _run(_engine(sd_eps_path, decode_stage=False))


@pytest.mark.slow
def test_images_and_previews_equal_the_loops_and_no_decode_runs_in_the_loop(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)
    threads = _decode_spy(engine, monkeypatch)
    staged = _run(engine)
    assert set(threads) == {"dvllm-decode"}
    for request_id, outs in in_loop.items():
        final, want = staged[request_id][-1], outs[-1]
        assert final.finished and final.error is None and len(final.images) == len(want.images)
        for got, image in zip(final.images, want.images):
            np.testing.assert_array_equal(got, image)
        previews = [p for o in staged[request_id] for p in o.previews]
        expected = [p for o in outs for p in o.previews]
        assert len(previews) == len(expected)
        # each preview says which step it shows: in the loop the step it came with, off it the same step
        assert [o.preview_step for o in outs if o.previews] == [o.num_steps_done for o in outs if o.previews]
        shown = [(o.preview_step, o.num_steps_done) for o in staged[request_id] if o.previews]
        assert [step for step, _ in shown] == [o.preview_step for o in outs if o.previews]
        assert all(step <= done for step, done in shown)
        for got, image in zip(previews, expected):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(image))
    assert len([p for o in staged["3"] for p in o.previews]) == 2
    assert not engine.has_unfinished_requests() and _stage(engine).pending == 0


@pytest.mark.slow
def test_a_failing_decode_fails_its_request_only(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)

    def fail_large(latents, size):
        if size == (32, 16):
            raise RuntimeError("VAE out of memory")

    _decode_spy(engine, monkeypatch, fail_large)
    staged = _run(engine)
    assert staged["2"][-1].error == "decode failed: RuntimeError: VAE out of memory"
    assert staged["2"][-1].finished and staged["2"][-1].images == []
    for request_id in ("0", "1", "3"):
        assert staged[request_id][-1].error is None
        np.testing.assert_allclose(staged[request_id][-1].images[0], in_loop[request_id][-1].images[0], atol=1e-5)


class _ThreadKilled(BaseException):
    """Ends the decode thread as an uncaught error in it would."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, on purpose
def test_a_decode_thread_that_dies_loses_no_request(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)
    killed = []

    def die_once(latents, size):
        if not killed:
            killed.append(size)
            raise _ThreadKilled

    _decode_spy(engine, monkeypatch, die_once)
    staged = _run(engine)
    assert killed and _stage(engine).restarts == 1
    for request_id, outs in in_loop.items():
        assert staged[request_id][-1].error is None
        np.testing.assert_allclose(staged[request_id][-1].images[0], outs[-1].images[0], atol=1e-5)


def test_an_abort_while_decoding_ends_the_request_once(sd_eps_path, monkeypatch):
    engine = _engine(sd_eps_path)
    entered, release = threading.Event(), threading.Event()

    def block(latents, size):
        entered.set()
        assert release.wait(60)

    _decode_spy(engine, monkeypatch, block)
    engine.add_request("r", "a red circle", P(seed=1))
    outputs = []
    while not entered.is_set():
        outputs += engine.step()
    assert engine.stats()["num_decoding"] == 1 and engine.stats()["pool_used_blocks"] == 0  # its blocks are free
    assert engine.abort_request("r")
    release.set()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.step()
    assert [(o.error, o.images) for o in outputs if o.finished] == [("request aborted", [])]


def test_a_full_stage_leaves_the_decode_to_the_loop(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path, max_decode_queue=1)
    threads = _decode_spy(engine, monkeypatch)
    staged = _run(engine, REQUESTS[:2])  # three images finish together: one fits the stage
    assert "dvllm-decode" in threads and threading.current_thread().name in threads
    for request_id in ("0", "1"):
        for got, image in zip(staged[request_id][-1].images, in_loop[request_id][-1].images):
            np.testing.assert_allclose(got, image, atol=1e-5)


def test_closing_the_stage_drains_it():
    release = threading.Event()

    def decode(latents, counts, size, tiled):
        assert release.wait(60)
        return latents * 2

    stage = DecodeStage(decode, lambda images, kind: [kind, images.clone()], torch.device("cpu"), max_batch=2,
                        capacity=8)
    jobs = [DecodeJob(f"r{i}", torch.full((1, 2), float(i)), (8, 8), "np") for i in range(3)]
    stage.submit(jobs)
    closer = threading.Thread(target=stage.close)
    closer.start()
    release.set()
    closer.join(60)
    assert not closer.is_alive() and stage.pending == 0
    done = stage.collect()
    assert sorted(done.images) == ["r0", "r1", "r2"] and not done.errors
    assert float(done.images["r2"][1][0, 0]) == 4.0


@pytest.mark.slow
def test_the_stage_metrics_count_each_stage_where_it_ran(sd_eps_path):
    """Requests encoded, rows denoised and images decoded (finals and previews), in the loop or on the
    stage's thread, through the engine's stats, Prometheus and the benchmark's reading of two scrapes."""
    from dvllm.benchmarks.server_usage import server_usage
    from dvllm.entrypoints.metrics import ServerMetrics

    rows = sum(p.n * 2 * p.num_inference_steps for _, p in REQUESTS)
    images = sum(p.n for _, p in REQUESTS) + 2  # and the two previews
    for decode_stage, where in ((True, "decode_stage"), (False, "decode")):
        engine = _engine(sd_eps_path, decode_stage=decode_stage)
        metrics = ServerMetrics(engine.stats, lambda: 0)
        before = metrics.render().decode()
        _run(engine)
        metrics.on_step(engine.last_step, [])
        stats = engine.stats()
        elsewhere = "decode" if where == "decode_stage" else "decode_stage"
        assert stats["stage_items"] == {"encode": len(REQUESTS), "encode_stage": 0, "denoise": rows, where: images,
                                        elsewhere: 0}
        assert all(stats["stage_seconds"][s] > 0 for s in ("encode", "denoise", where))
        usage = server_usage(before, metrics.render().decode(), duration=1.0)["stages"]
        assert {s: u["items"] for s, u in usage.items()} == stats["stage_items"]
        assert usage[where]["occupancy"] == pytest.approx(stats["stage_seconds"][where])
