"""Decode workers: processes of their own decode the decode stage's batches with a copy of the VAE. Their images
are the in-loop decode's, pixel for pixel, for every family; the worker's process runs no VAE decode; a
process killed mid-batch loses no request; a job whose process dies twice fails its request only; shutdown
stops the processes; and what cannot work is refused at start."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch
from test_decode_stage import _stage

from dvllm import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, SamplingParams
from dvllm.models.loader import load_adapter
from dvllm.worker.decode_stage import DecodeJob, DecodeStage
from dvllm.worker.decode_worker import VaeCopy
from dvllm.worker.stage_config import StageConfig
from dvllm.worker.stage_process import WorkerProcessLost, same_gpu

# Waiting on another process's progress: generous, as the suite runs on a loaded machine
_DEADLINE_S = 120


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


REQUESTS = [("a red circle", P(seed=1)), ("a blue square", P(seed=2, n=2)), ("a green star", P(seed=3, height=32)),
            ("a yellow moon", P(seed=4, num_inference_steps=5, output_kind="progress", num_previews=2)),
            ("a pink heart", P(seed=5, output_type="pil"))]


def _engine(path: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=path, device="cpu", dtype="float32", max_image_pixels=64 * 64, **kwargs)


def _add(engine: DiffusionEngine, requests=REQUESTS) -> None:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)


def _finish(engine: DiffusionEngine, outputs: dict[str, list] | None = None) -> dict[str, list]:
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _pixels(image) -> np.ndarray:
    return np.asarray(image)


def _assert_same_outputs(got: dict[str, list], want: dict[str, list]) -> None:
    assert got.keys() == want.keys()
    for request_id, outs in want.items():
        final = got[request_id][-1]
        assert final.finished and final.error is None, final.error
        assert len(final.images) == len(outs[-1].images)
        for a, b in zip(final.images, outs[-1].images):
            np.testing.assert_array_equal(_pixels(a), _pixels(b))
        previews = [_pixels(p) for o in got[request_id] for p in o.previews]
        expected = [_pixels(p) for o in outs for p in o.previews]
        assert len(previews) == len(expected)
        for a, b in zip(previews, expected):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def in_loop(sd_eps_path) -> dict[str, list]:
    engine = _engine(sd_eps_path, decode_stage=False)
    _add(engine)
    return _finish(engine)


@pytest.mark.slow
def test_images_equal_the_loops_and_the_workers_process_runs_no_decode(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path, decode_workers=2)
    stage = _stage(engine)
    assert len(stage.workers) == 2 and all(w.pid not in (None, os.getpid()) for w in stage.workers)
    calls = []
    adapter = engine.executor.worker.runner.adapter
    real = adapter.decode
    monkeypatch.setattr(adapter, "decode", lambda *a: calls.append(a) or real(*a))
    _add(engine)
    _assert_same_outputs(_finish(engine), in_loop)
    assert calls == []  # every final image and preview was decoded by a process of its own
    engine.shutdown()


FAMILIES = [("sd_eps_path", 32), ("sdxl_path", 32), ("sd3_path", 32), ("flux_path", 32), ("qwen_image_path", 32),
            ("z_image_path", 32), ("wan_path", 16), ("tiny-sd", 128)]


@pytest.mark.parametrize("family, side", FAMILIES)
def test_the_vae_copy_decodes_as_the_adapter_does(family, side, request):
    """What a decode process rebuilds (VaeCopy.build) decodes each family's latents as its adapter, bit for bit
    (tiny-sd's dummy VAE at 128x128: a copy in eval mode, where the engine's is in training mode, is not; Wan's
    decode reads its pipeline's video processor, which image pipelines do not have)."""
    model = family if family == "tiny-sd" else request.getfixturevalue(family)
    adapter = load_adapter(model, "auto", torch.device("cpu"), torch.float32)
    size = (side, side)
    latents = torch.randn((2, *adapter.info.latents.shape(*size)), generator=torch.Generator().manual_seed(0))
    copy = VaeCopy.of(adapter)
    assert all(t.data_ptr() != p.data_ptr() for t, p in zip(copy.state.values(), adapter.pipeline.vae.parameters()))
    torch.testing.assert_close(copy.build(torch.device("cpu")).decode(latents, size), adapter.decode(latents, size),
                               rtol=0, atol=0)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_worker_killed_mid_batch_loses_no_request(sd_eps_path, in_loop):
    engine = _engine(sd_eps_path, decode_workers=1)
    stage = _stage(engine)
    (worker,) = stage.workers
    first = worker.pid
    os.kill(first, signal.SIGSTOP)  # it can answer nothing: the batch it is sent stays in flight
    outputs: dict[str, list] = {}
    _add(engine)
    deadline = time.monotonic() + _DEADLINE_S
    while not stage._taken:  # step until the lane has handed the process a batch
        assert time.monotonic() < deadline, "no batch reached the decode process"
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    os.kill(first, signal.SIGKILL)
    _assert_same_outputs(_finish(engine, outputs), in_loop)
    assert worker.restarts == 1 and worker.pid != first
    assert engine.stats()["stage_restarts"]["decode_stage.process"] == 1
    engine.shutdown()


@pytest.mark.slow
def test_a_core_process_runs_its_decode_workers_and_takes_them_down_with_it(sd_eps_path):
    """dvllm serve's engine core (a process of its own) starts the decode processes as its children; every image
    and preview streams back, and shutting the engine down leaves no decode process behind. (Pixels against the
    in-loop decode are test_images_equal_...'s, in this process. Here the requests reach a core that is already
    stepping, so on a loaded machine the two runs may batch them differently: one CI run saw 3e-7 between them,
    most likely the float rounding of other batch neighbours (2.5e-6 in encode_stall), not the decode.)"""
    from test_async_engine import collect
    from process_tree import dvllm_processes, zombie

    def decode_processes() -> list[int]:  # (the core's, forked by this process's fork server: its descendants)
        return dvllm_processes(os.getpid(), "dvllm-decode")

    async def run(**kwargs):
        engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_image_pixels=64 * 64,
                                      engine_core_process=True, **kwargs)
        decoders = decode_processes()
        engine.start()
        results = await asyncio.gather(*(collect(engine, prompt, params) for prompt, params in REQUESTS))
        await engine.shutdown(1)
        return {str(i): outs for i, outs in enumerate(results)}, decoders, engine.core_process.returncode

    reference, none, _ = asyncio.run(run(decode_stage=False))
    results, decoders, returncode = asyncio.run(run(decode_workers=1))
    assert none == [] and len(decoders) == 1 and returncode == 0
    assert results.keys() == reference.keys()
    for request_id, outs in reference.items():
        final, want = results[request_id][-1], outs[-1]
        assert final.finished and final.error is None and len(final.images) == len(want.images)
        assert sum(len(o.previews) for o in results[request_id]) == sum(len(o.previews) for o in outs)
    # gone, or a zombie: an orphan whose reaper (a container's pid 1) may never reap it
    _wait_until(lambda: zombie(decoders[0]),
                "the decode process to exit")


class _FakeWorker:
    """Decodes in the test's process; dies (raises WorkerProcessLost) as told."""

    def __init__(self, dies) -> None:
        self.dies, self.batches = dies, []

    def decode(self, batch):
        latents, size, jobs, _ = batch
        self.batches.append([n for n, _, _ in jobs])
        if self.dies(latents):
            raise WorkerProcessLost("killed")
        out, lo = [], 0
        for n, kind, _ in jobs:
            out.append([kind, latents[lo:lo + n].clone()])
            lo += n
        return out

    def close(self) -> None:
        pass


def _stage_with(worker: _FakeWorker) -> DecodeStage:
    return DecodeStage(lambda latents, counts, size, tiled: latents, lambda images, kind: [], torch.device("cpu"),
                       max_batch=4, capacity=16, workers=[worker])


def test_a_batch_whose_worker_died_is_decoded_again_then_job_by_job():
    deaths = iter([True, True])  # the batch dies twice: then each job is tried alone, and lives
    worker = _FakeWorker(lambda latents: next(deaths, False))
    stage = _stage_with(worker)
    stage.submit([DecodeJob(str(i), torch.full((1, 2), float(i)), (8, 8), "np") for i in range(3)])
    stage.close()
    done = stage.collect()
    assert worker.batches == [[1, 1, 1], [1, 1, 1], [1], [1], [1]]
    assert not done.errors and sorted(done.images) == ["0", "1", "2"]


def test_a_job_whose_worker_dies_twice_fails_its_request_only():
    worker = _FakeWorker(lambda latents: bool((latents == 1).any()))  # job "1" kills every process it reaches
    stage = _stage_with(worker)
    jobs = [DecodeJob(str(i), torch.full((1, 2), float(i)), (8, 8), "np") for i in range(3)]
    jobs.append(DecodeJob("1", torch.full((1, 2), 1.0), (8, 8), "pil", preview=True, step=2))
    stage.submit(jobs)
    stage.close()
    done = stage.collect()
    assert sorted(done.images) == ["0", "2"] and "died" not in str(done.images)
    assert list(done.errors) == ["1"] and "WorkerProcessLost" in done.errors["1"]
    assert not done.previews  # a preview lost is no failure


@pytest.mark.slow
def test_shutdown_drains_the_stage_and_stops_the_processes(sd_eps_path, in_loop):
    engine = _engine(sd_eps_path, decode_workers=2)
    stage = _stage(engine)
    processes = [w.process for w in stage.workers]
    outputs: dict[str, list] = {}
    _add(engine)
    deadline = time.monotonic() + _DEADLINE_S
    while not stage.pending:  # some images handed over, not yet decoded
        assert time.monotonic() < deadline, "nothing was handed to the decode stage"
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    handed = stage._queued_images()
    engine.executor.worker.close()
    done = stage.collect()
    assert stage.pending == 0 and done.num_images >= handed > 0 and not done.errors  # drained: all decoded
    _wait_until(lambda: all(p.poll() is not None for p in processes), "the decode processes to exit")


@pytest.mark.parametrize("kwargs, message", [
    (dict(decode_workers=-1), "decode_workers must be an integer"),
    (dict(decode_workers=True), "decode_workers must be an integer"),
    (dict(decode_workers=1, decode_stage=False), "decode_stage=False"),
    (dict(decode_device="cpu"), "decode_workers is 0"),
    (dict(decode_workers=1, decode_device="tpu"), "decode_device must be"),
    (dict(decode_workers=2, decode_device="cpu,cuda:x"), "decode_device must be"),
])
def test_what_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageConfig.of(EngineConfig(model="tiny-shapes", **kwargs))


def test_a_gpu_the_worker_does_not_see_is_no_decode_device(sd_eps_path):
    from dvllm.worker import decode_worker

    adapter = load_adapter(sd_eps_path, "auto", torch.device("cpu"), torch.float32)
    for device in ("cuda:3", "cuda"):
        with pytest.raises(ValueError, match="sees 0 GPU"):
            decode_worker.start_decode_workers(adapter, 1, ["cpu", device], torch.device("cpu"))


def test_a_gpu_workers_own_gpu_is_no_decode_device():
    assert same_gpu(torch.device("cuda:1"), torch.device("cuda:1"))
    assert not same_gpu(torch.device("cuda:1"), torch.device("cuda:0"))
    assert not same_gpu(torch.device("cpu"), torch.device("cuda:0"))
    stages = StageConfig.of(EngineConfig(decode_workers=2, decode_device="cuda:1, cpu"))
    assert stages.decode_devices == ("cuda:1", "cpu")


def test_no_job_overtakes_an_earlier_job_of_its_request():
    """Batches group by size and kind, skipping over jobs; a request's later jobs never skip its earlier one (a
    preview would come back after the final images), nor go while it is in flight on another lane."""
    stage = _stage_with(_FakeWorker(lambda latents: False))

    def job(request_id: str, preview: bool = False) -> DecodeJob:
        return DecodeJob(request_id, torch.zeros(1, 2), (8, 8), "np", preview=preview)

    final_0, preview_3, final_3, final_4 = job("0"), job("3", True), job("3"), job("4")
    stage._jobs.extend([final_0, preview_3, final_3, final_4])
    assert stage._take() == [final_0, final_4]  # final_3 waits behind preview_3
    assert stage._take() == [preview_3]
    stage._taken_by[0] = [preview_3]  # in flight on lane 0
    assert stage._take() == []  # final_3 waits for it
    del stage._taken_by[0]
    assert stage._take() == [final_3]


def test_a_vae_that_cannot_be_copied_is_refused_at_start(sd_eps_path, monkeypatch):
    from dvllm.worker import decode_worker

    adapter = load_adapter(sd_eps_path, "auto", torch.device("cpu"), torch.float32)
    vae = adapter.pipeline.vae
    monkeypatch.setattr(vae, "state_dict", lambda: {"encoder.weight": torch.zeros(2, dtype=torch.int8)})
    with pytest.raises(ValueError, match="not a plain float tensor"):
        decode_worker.start_decode_workers(adapter, 1, ["cpu"], torch.device("cpu"))


def test_results_done_between_two_collects_reach_them_one_a_request_in_order():
    """Two previews of a request finished before the loop collects: both are handed over, a collect apart, and
    the final images after them (the later preview used to replace the earlier one, final images beside it)."""
    stage = _stage_with(_FakeWorker(lambda latents: False))
    stage.submit([DecodeJob("r", torch.full((1, 2), 1.0), (8, 8), "pil", preview=True, step=2),
                  DecodeJob("o", torch.full((1, 2), 5.0), (8, 8), "np"),
                  DecodeJob("r", torch.full((1, 2), 2.0), (8, 8), "pil", preview=True, step=4),
                  DecodeJob("r", torch.full((1, 2), 3.0), (8, 8), "np")])
    stage.close()  # everything decoded, nothing collected yet
    first, second, third = stage.collect(), stage.collect(), stage.collect()
    assert first.preview_steps == {"r": 2} and sorted(first.images) == ["o"] and first.num_images == 4
    assert second.preview_steps == {"r": 4} and not second.images
    assert list(third.images) == ["r"] and not third.previews and stage.pending == 0
