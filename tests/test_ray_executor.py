"""The Ray executor on a local Ray runtime with CPU workers: same images as in-process, a killed
worker loses nothing, a cluster started on its own is joined by address, and resources the
cluster lacks fail fast. Ray start-up takes seconds, so the tests are few and each does much."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from utils_cli import restore_logging  # noqa: F401 (autouse: main() sets the process's logging; put back)

from dvllm import DiffusionEngine, SamplingParams

ray = pytest.importorskip("ray")  # `.[test]`, not the fast tier's `.[dev]`

pytestmark = pytest.mark.slow

PROMPTS = [f"a photo of object number {i}" for i in range(8)]


def _params() -> list[SamplingParams]:
    """Mixed: step counts, CFG on and off, two samplers, n=2."""
    return [SamplingParams(seed=100 + i, num_inference_steps=3 + i % 4, guidance_scale=(1.0 if i % 3 == 0 else 5.0),
                           sampler=("euler" if i % 2 else None), n=(2 if i == 5 else 1), output_type="np")
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(sd_eps_path) -> list[list[np.ndarray]]:
    engine = DiffusionEngine(sd_eps_path)
    return [out.images for out in engine.generate(PROMPTS, _params(), use_tqdm=False)]


def _add_and_find_victim(engine, also=lambda core: True) -> int:
    """Adds a request per prompt and steps until a live worker (one that `also` picks) runs a request that has
    taken a step: its index."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(f"r{i}", prompt, params)
    while True:
        engine.step()
        for core in engine.coordinator.live():
            if also(core) and any(r.num_steps_done > 0 for r in core.scheduler.running):
                return core.index


def _assert_same(outputs, reference) -> None:
    for out, ref in zip(outputs, reference):
        assert out.error is None, out.error
        assert len(out.images) == len(ref)
        for image, expected in zip(out.images, ref):
            # one torch thread per Ray worker vs the test's own: float sums may differ in the last bits
            assert np.abs(np.asarray(image) - np.asarray(expected)).max() < 1e-5


def _run_to_completion(engine: DiffusionEngine, timeout: float = 300, on_step=lambda: None) -> dict:
    finished = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished  # one final output each
                finished[out.request_id] = out
        on_step()
    return finished


def test_two_workers_match_in_process_and_survive_a_killed_worker(sd_eps_path, reference):
    assert not ray.is_initialized()
    engine = DiffusionEngine(sd_eps_path, executor="ray", num_workers=2, worker_num_cpus=1)
    try:
        assert ray.is_initialized()  # the engine started a local Ray
        _assert_same(engine.generate(PROMPTS, _params(), use_tqdm=False), reference)
        workers = engine.worker_stats()
        assert [w["worker"] for w in workers] == [0, 1]
        assert all(w["alive"] and w["steps"] > 0 and w["rows_per_step"] > 0 for w in workers)  # both took work

        # Mid-run, kill the worker holding requests that have taken steps: they start over elsewhere.
        victim = _add_and_find_victim(engine)
        moved = {rid for rid, lane in engine.coordinator.home.items() if lane.index == victim}
        assert moved
        ray.kill(engine.executor.actors[victim], no_restart=True)
        alive = []
        finished = _run_to_completion(engine, on_step=lambda: alive.append(engine.stats()["num_workers_alive"]))
        assert 1 in alive  # degraded while the worker restarts
        assert sorted(finished) == sorted(f"r{i}" for i in range(len(PROMPTS)))  # nothing lost
        _assert_same([finished[f"r{i}"] for i in range(len(PROMPTS))], reference)  # identical images
        assert engine.coordinator.cores[victim].restarts == 1

        # The dead worker comes back (restarted in its placement-group bundle) and takes work again.
        deadline = time.monotonic() + 120
        while engine.stats()["num_workers_alive"] < 2:
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            engine.step()
            time.sleep(0.1)
        _assert_same(engine.generate(PROMPTS, _params(), use_tqdm=False), reference)
        assert engine.worker_stats()[victim]["steps"] > 0
    finally:
        engine.shutdown()
    assert not ray.is_initialized()  # the engine stops the Ray it started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head():
    """A Ray cluster of its own process group, on loopback, with 2 CPUs and no GPU."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_bin = Path(sys.executable).with_name("ray")
    assert ray_bin.exists() or shutil.which("ray"), "the ray command line is missing"
    # Loopback only, so without Ray's token authentication: a driver joins it whatever its own auth mode
    # (this process may already be in token mode from a local ray.init, and Ray caches the mode).
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [str(ray_bin if ray_bin.exists() else shutil.which("ray")), "start", "--head", "--block",
         f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
         "--include-dashboard=false", f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        _wait_for_cluster(address, head)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.killpg(head.pid, signal.SIGKILL)  # the whole cluster: gcs, raylet, workers (SIGTERM drains for 30 s)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_cluster(address: str, head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert head.poll() is None, f"ray start --head exited with {head.returncode}"
        try:
            ray.init(address=address, include_dashboard=False)
            if any(node["Alive"] for node in ray.nodes()):
                return
        except ConnectionError:
            pass
        finally:
            if ray.is_initialized():
                ray.shutdown()
        assert time.monotonic() < deadline, "ray start --head did not come up"
        time.sleep(1)


_JOINING_DRIVER = """
import sys, time, numpy as np, pytest, ray
from dvllm import DiffusionEngine, SamplingParams
model, address, out = sys.argv[1:4]
# The engine joins the cluster itself (ray.init(address)) and leaves it (ray.shutdown) when done.
engine = DiffusionEngine(model, executor="ray", ray_address=address, num_workers=1)
try:
    assert engine.worker_stats()[0]["node_ip"] == ray.nodes()[0]["NodeManagerAddress"]
    params = [SamplingParams(**p) for p in eval(sys.argv[4])]
    outs = engine.generate(sys.argv[5].split("|"), params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    np.savez(out, *[np.asarray(o.images[0]) for o in outs])
finally:
    engine.shutdown()
assert not ray.is_initialized()
# Then what the cluster cannot hold: the message names the missing resource and each node with what
# it has. (These come last: Ray 2.60 may lose actors made after re-joining a cluster in one process.)
start = time.monotonic()
with pytest.raises(RuntimeError, match=r"cannot host 1 worker\\(s\\).*missing GPU.*node [\\d.]+: CPU 2, GPU 0"):
    DiffusionEngine(model, executor="ray", ray_address=address, worker_num_gpus=1)
with pytest.raises(RuntimeError, match=r"missing CPU \\(asked 3 in all"):
    DiffusionEngine(model, executor="ray", ray_address=address, num_workers=3)
assert time.monotonic() - start < 60  # fast: no waiting for resources that never come
"""


def test_join_a_cluster_by_address_and_fail_fast_on_missing_resources(sd_eps_path, reference, ray_head, tmp_path):
    # A driver process of its own, as in production (Ray keeps per-process state across clusters).
    params = [dict(seed=p.seed, num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                   sampler=p.sampler, output_type="np") for p in _params()[:3]]
    out = tmp_path / "images.npz"
    # The driver's auth mode must match the cluster's (none, see ray_head): a local ray.init earlier in
    # this process set RAY_AUTH_MODE=token in os.environ, and the workers of a token-mode job on a
    # cluster without auth never start.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    run = subprocess.run([sys.executable, "-c", _JOINING_DRIVER, sd_eps_path, ray_head, str(out), repr(params),
                          "|".join(PROMPTS[:3])], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    images = np.load(out)
    for k, expected in enumerate(reference[:3]):
        assert np.abs(images[f"arr_{k}"] - np.asarray(expected[0])).max() < 1e-5


class _DegradedEngine:
    """What the server reads of an engine whose worker 1 of 2 is dead."""

    is_running = True
    loaded_model = type("Loaded", (), {"name": "tiny"})()
    step_listeners: list = []

    def __init__(self, alive: int) -> None:
        workers = [{"worker": i, "alive": i < alive, "rows_per_step": 2.0, "steps_per_s": 10.0,
                    "pool_used_blocks": 0, "restarts": 0} for i in range(2)]
        self._stats = {"num_running": 0, "num_waiting": 0, "num_preemptions": 0, "pool_total_blocks": 8,
                       "pool_used_blocks": 0, "pool_cached_blocks": 0, "prompt_cache_hits": 0,
                       "prompt_cache_queries": 0, "cache_skipped_rows": 0, "cache_computed_rows": 0,
                       "lora_slot_loads": 0, "loras_resident": 0, "num_workers": 2,
                       "num_workers_alive": alive, "workers": workers}

    def stats(self) -> dict:
        return self._stats


@pytest.mark.parametrize("alive, status", [(2, 200), (1, 200), (0, 503)])
def test_health_and_metrics_say_degraded(alive, status):
    from argparse import Namespace

    from fastapi.testclient import TestClient

    from dvllm.entrypoints.api_server import build_app

    app = build_app(_DegradedEngine(alive), Namespace())
    client = TestClient(app)  # no lifespan: the stub has no loop to start
    health = client.get("/health")
    assert health.status_code == status
    if status == 200:
        assert health.json() == {"status": "ok" if alive == 2 else "degraded", "workers": 2, "workers_alive": alive}
    metrics = client.get("/metrics").text
    assert f"dvllm_num_workers_alive {float(alive)}" in metrics
    assert f'dvllm_worker_alive{{worker="1"}} {1.0 if alive == 2 else 0.0}' in metrics


def test_the_harness_runs_ray_workers_beside_one_thread_in_process(sd_eps_path, tmp_path):
    """`dvllm bench run` with the data-parallel variants (what `bench throughput --executor ray` measured): one
    in-process worker of one thread against two Ray workers of one CPU each, on the same requests."""
    from dvllm.entrypoints.cli import main as dvllm_main

    out = tmp_path / "ray.json"
    assert dvllm_main(["bench", "run", "--model", sd_eps_path, "--device", "cpu", "--dtype", "float32",
                       "--generate", "uniform", "--num", "4", "--rate", "inf", "--size-divisor", "32",
                       "--clamp-steps", "2", "--engine-variant", "one:threads=1",
                       "--engine-variant", "ray2:executor=ray,num_workers=2,worker_num_cpus=1",
                       "--contenders", "one,ray2", "--output-json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]["contenders"]
    assert list(run) == ["one", "ray2"]
    for name, (s,) in run.items():
        assert (s["completed"], s["failed"]) == (4, 0) and s["images_per_s"] > 0, (name, s["errors"])
    assert not ray.is_initialized()


# The tests above start and stop a Ray of their own (what they check); those below share one local Ray runtime,
# started once for the module: Ray's start-up is seconds of the machine's two cores, and what they check is the
# executor on a running Ray (the engine joins a Ray it finds initialized and leaves it running).
@pytest.fixture(scope="module")
def shared_ray():
    assert not ray.is_initialized()
    ray.init(include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def test_a_request_that_dies_on_every_worker_fails_instead_of_hanging(sd_eps_path, shared_ray):
    engine = DiffusionEngine(sd_eps_path, executor="ray", num_workers=1, max_worker_restarts=0)
    try:
        engine.add_request("doomed", "a photo", SamplingParams(seed=1, num_inference_steps=50))
        engine.step()
        ray.kill(engine.executor.actors[0], no_restart=True)
        finished = _run_to_completion(engine, timeout=60)
        assert "died on every try" in finished["doomed"].error
        assert engine.stats()["num_workers_alive"] == 0
        with pytest.raises(RuntimeError, match="every worker is dead"):
            engine.add_request("late", "a photo")
    finally:
        engine.shutdown()


def test_lora_adapters_travel_to_ray_workers(sd_eps_path, tmp_path, shared_ray):
    """Adapters are checked on the driver and cross as ids, each worker reading the file when a slot loads it: two
    Ray workers give the in-process engine's images for a mix of adapters."""
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    adapters = {"style": make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=5,
                                   components=("unet", "text_encoder"))}
    params = [SamplingParams(num_inference_steps=3, seed=s, height=16, width=16, output_type="np", loras=loras)
              for s, loras in ((1, {"style": 0.7}), (2, None), (3, {"style": 1.0}), (4, {"style": -0.5}))]
    prompts = ["a red circle", "a blue square", "a red circle", "a green circle"]
    local = DiffusionEngine(sd_eps_path, lora_modules=adapters).generate(prompts, params, use_tqdm=False)
    engine = DiffusionEngine(sd_eps_path, executor="ray", num_workers=2, worker_num_cpus=1, lora_modules=adapters)
    try:
        remote = engine.generate(prompts, params, use_tqdm=False)
        assert engine.stats()["lora_slot_loads"] >= 1
    finally:
        engine.shutdown()
    for want, got in zip(local, remote):
        assert got.error is None, got.error
        np.testing.assert_allclose(got.images[0], want.images[0], atol=1e-3, rtol=0)


def test_a_worker_that_dies_idle_is_noticed_by_the_heartbeat(sd_eps_path, shared_ray):
    """No request is running, so no step would notice: the heartbeat must, and the async engine's
    stats (what /health reads) say degraded within seconds; the worker is restarted."""
    import asyncio

    from dvllm.engine.async_engine import AsyncDiffusionEngine

    engine = AsyncDiffusionEngine(sd_eps_path, executor="ray", num_workers=2, worker_num_cpus=1,
                                  worker_heartbeat_s=0.2)

    async def scenario() -> list[int]:
        engine.start()
        seen = []
        try:
            ray.kill(engine.engine.executor.actors[1], no_restart=True)
            deadline = time.monotonic() + 120
            while engine.stats()["num_workers_alive"] == 2:
                assert time.monotonic() < deadline, "the idle worker's death went unnoticed"
                await asyncio.sleep(0.05)
            seen.append(engine.stats()["num_workers_alive"])
            while engine.stats()["num_workers_alive"] < 2:  # restarted in its bundle
                assert time.monotonic() < deadline, "the dead worker was not restarted"
                await asyncio.sleep(0.1)
            seen.append(engine.stats()["num_workers_alive"])
            out = [o async for o in engine.generate("after", SamplingParams(num_inference_steps=2, seed=1))][-1]
            assert out.error is None
        finally:
            await engine.shutdown(grace_seconds=5)
        return seen

    assert asyncio.run(scenario()) == [1, 2]
    assert engine.engine.coordinator.cores[1].restarts == 1


def test_decode_encode_and_group_processes_run_beside_a_ray_worker_on_its_node(sd_eps_path, reference,
                                                                              shared_ray):
    """A Ray worker starts its decode and encode processes, and its group's member (CFG-parallel: each CFG
    request's unconditional rows run there), on its node: the images are the in-process engine's, every one
    decoded by the decode stage (not in the loop), every text encoded by the encode stage, and the processes are
    the actor's (forked by its fork server)."""
    from process_tree import dvllm_processes

    engine = DiffusionEngine(sd_eps_path, executor="ray", num_workers=1, worker_num_cpus=1, decode_workers=1,
                             encode_workers=1, cfg_parallel_size=2)
    try:
        _assert_same(engine.generate(PROMPTS, _params(), use_tqdm=False), reference)
        stats = engine.stats()
        assert stats["stage_items"]["decode_stage"] == sum(p.n for p in _params())
        assert stats["stage_items"]["decode"] == 0
        assert stats["stage_items"]["encode_stage"] > 0
        actor = engine.executor.nodes[0]["pid"]
        for name in ("dvllm-decode", "dvllm-encode", "dvllm-member"):
            assert dvllm_processes(actor, name) != [], name
    finally:
        engine.shutdown()


def test_async_scheduling_queues_each_workers_next_step_and_survives_a_killed_worker(sd_eps_path, reference,
                                                                                     shared_ray):
    """With async scheduling each Ray worker gets its next step submitted behind the one it runs: the images are
    the in-process engine's, and a worker killed with steps queued loses no request."""
    engine = DiffusionEngine(sd_eps_path, executor="ray", num_workers=2, worker_num_cpus=1, async_scheduling=True)
    executor, queued = engine.executor, []
    real_submit = executor.submit

    def submit(worker, scheduler_output):
        real_submit(worker, scheduler_output)
        queued.append(sum(1 for w in executor._in_flight.values() if w == worker))

    executor.submit = submit
    try:
        _assert_same(engine.generate(PROMPTS, _params(), use_tqdm=False), reference)
        assert max(queued) == 2  # a step queued behind the running one

        victim = _add_and_find_victim(engine, lambda core: bool(core.submitted))  # one with steps queued
        ray.kill(executor.actors[victim], no_restart=True)
        finished = _run_to_completion(engine)
        assert sorted(finished) == sorted(f"r{i}" for i in range(len(PROMPTS)))  # nothing lost
        _assert_same([finished[f"r{i}"] for i in range(len(PROMPTS))], reference)
        assert engine.coordinator.cores[victim].restarts == 1
    finally:
        engine.shutdown()
