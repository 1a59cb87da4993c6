"""LoRA adapters cross the control plane as ids (dvllm/lora/ref.py): requests, the scheduler's slots, its
outputs and the core process's pipe carry names, paths and digests, never weights; whoever applies an adapter
reads its file itself (dvllm/lora/cache.py) and checks it is the one loaded."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading

import pytest
from lora_utils import make_lora
from safetensors.torch import load_file, save_file
from scheduler_utils import Clock, make

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput
from dvllm.lora.cache import lora_cache_for
from dvllm.lora.ref import LoraRef, file_digest
from dvllm.lora.registry import registry_for

WEIGHTS = "pytorch_lora_weights.safetensors"
REQUEST = dict(num_inference_steps=2, height=16, width=16, output_type="np", seed=1)


def _ref(name: str, digest: str, text: bool = False) -> LoraRef:
    return LoraRef(name, uid=len(name), path=f"/adapters/{name}.safetensors", digest=digest, rank=4,
                   has_text_encoder=text)


def _lora_request(clock: Clock, rid: str, *refs: LoraRef):
    request = clock.request(rid, steps=3)
    request.loras = tuple((ref, 0.5) for ref in refs)
    return request


def test_a_lora_requests_control_messages_are_small_and_hold_no_torch_objects():
    """What the server pipes to the core ("add", Request) and what the scheduler hands the worker
    (SchedulerOutput: the slot loads, the new request's rows' adapters) unpickle in an interpreter that never
    imports torch: no tensor, no module of weights rides along."""
    s, clock = make(max_loras=2), Clock()
    request = _lora_request(clock, "a", _ref("style", "d1" * 16, text=True), _ref("detail", "d2" * 16))
    command = pickle.dumps(("add", request), protocol=5)
    s.add_request(request)
    out = s.schedule()
    assert [(slot, ref.name) for slot, ref in out.lora_loads] == [(0, "style"), (1, "detail")]
    assert out.new_requests[0].loras == (("d1" * 16, 0.5), ("d2" * 16, 0.5))
    assert out.new_requests[0].text_loras == (("d1" * 16, 0.5),)
    step = pickle.dumps(out, protocol=5)
    assert len(command) < 4096 and len(step) < 4096, (len(command), len(step))
    code = ("import pickle, sys\n"
            f"pickle.loads({command!r}); pickle.loads({step!r})\n"
            "print(sorted(n for n in ('torch', 'diffusers', 'peft') if n in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_slots_know_an_adapter_by_its_files_digest():
    """Two names for one file take one slot (one load); another file takes another."""
    s, clock = make(max_loras=2), Clock()
    one, same, other = _ref("one", "aa" * 16), _ref("same", "aa" * 16), _ref("other", "bb" * 16)
    s.add_request(_lora_request(clock, "a", one))
    s.add_request(_lora_request(clock, "b", same))
    out = s.schedule()
    assert [slot for slot, _ in out.lora_loads] == [0] and s.lora_slots.num_resident == 1
    s.add_request(_lora_request(clock, "c", other))
    ask = s.schedule()  # "a" and "b" run: "c" waits for its file to be read, off the worker's loop
    assert not ask.lora_loads and [ref.name for ref in ask.lora_reads] == ["other"]
    s.update_from_output(ask, RunnerOutput(loras_read=[other.digest]))
    assert [slot for slot, _ in s.schedule().lora_loads] == [1]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    from conftest import tiny_sd_pipeline

    folder, pipe = tmp_path_factory.mktemp("lora-refs"), tiny_sd_pipeline()
    return {name: make_lora(pipe, str(folder / name), seed=seed) for name, seed in (("a", 1), ("b", 2))}


def test_the_registry_hands_out_ids_and_the_workers_cache_reads_each_file_once(sd_eps_path, adapters, tmp_path):
    config = EngineConfig(model=sd_eps_path, device="cpu", enable_lora=True, max_cpu_loras=1)
    registry, cache = registry_for(config, "base"), lora_cache_for(config)
    a = registry.load("a", adapters["a"])
    also_a = registry.load("also-a", adapters["a"])
    b = registry.load("b", adapters["b"])
    assert a.path == also_a.path == os.path.join(adapters["a"], WEIGHTS) and a.digest == file_digest(a.path)
    assert a.uid != also_a.uid and a.digest == also_a.digest != b.digest  # two loads, one file
    assert registry.ref("a") == a and a.rank == 4
    weights = cache.weights(a)
    assert cache.weights(also_a) is weights and cache.reads == 1  # by digest: one read for both names
    assert weights.digest == a.digest and weights.rank == a.rank and weights.has_text_encoder == a.has_text_encoder
    cache.weights(b)  # max_cpu_loras=1: a leaves
    assert a.digest not in cache and b.digest in cache and cache.reads == 2


def test_a_file_changed_after_admission_fails_only_its_requests_at_the_worker(sd_eps_path, adapters, tmp_path):
    """Admission checked the file (a stat); replaced before the worker read it, the worker's digest check refuses
    it, failing the requests that use it, naming why, and nothing else."""
    copy = shutil.copytree(adapters["a"], tmp_path / "a")
    request = dict(REQUEST, guidance_scale=1.0)  # no CFG: the two share no prompt-cache entry, only the step
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules={"a": str(copy)})
    try:
        engine.add_request("styled", "a red circle", SamplingParams(**request, loras={"a": 1.0}))
        engine.add_request("plain", "a blue square", SamplingParams(**request))
        tensors = load_file(str(copy / WEIGHTS))
        save_file({k: v * 2 for k, v in tensors.items()}, str(copy / WEIGHTS))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        error = finished["styled"].error
        assert error is not None and "could not be loaded on the worker" in error and "its file changed" in error
        assert finished["plain"].error is None
        assert engine.stats()["loras_resident"] == 0  # the slot was forgotten
    finally:
        engine.shutdown()


def test_while_requests_run_a_lora_request_waits_for_its_read_and_a_dropped_adapter_is_read_again():
    """Nothing running, an adapter is read in the step that loads it (no one waits); while requests run, a
    request whose adapter is not read waits, the worker reads it off its loop, and requests without go on."""
    s, clock = make(max_loras=1), Clock()  # a host cache of two: one read asked at a time
    one, two = _ref("one", "aa" * 16), _ref("two", "bb" * 16)
    s.add_request(clock.request("running", steps=9))
    assert [r.request_id for r in s.schedule().new_requests] == ["running"]
    for request in (_lora_request(clock, "a", one), clock.request("plain", steps=3), _lora_request(clock, "b", two)):
        s.add_request(request)
    out = s.schedule()
    assert [r.request_id for r in out.new_requests] == ["plain"] and not out.lora_loads
    assert [ref.name for ref in out.lora_reads] == ["one"]  # "b" waits behind "a" for the one slot
    again = s.schedule()
    assert not again.lora_reads and not again.new_requests  # asked once; still reading
    s.update_from_output(again, RunnerOutput(loras_read=[one.digest]))
    out = s.schedule()
    assert [r.request_id for r in out.new_requests] == ["a"] and [ref.name for _, ref in out.lora_loads] == ["one"]
    assert [ref.name for ref in out.lora_reads] == ["two"]  # read while "a" holds the slot
    s.update_from_output(out, RunnerOutput(loras_read=[two.digest], loras_dropped=[two.digest]))
    assert [ref.name for ref in s.schedule().lora_reads] == ["two"]  # let go before its load: read again


def test_adapter_files_are_read_off_the_step_loop_and_a_slow_read_stalls_no_one(sd_eps_path, adapters):
    """While a request runs, the worker reads a new request's adapter on its reader thread: a read that does not
    end holds that request only; the running one takes its steps and finishes meanwhile."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules={"a": adapters["a"]})
    cache = engine.executor.worker.runner.lora_cache
    release, threads = threading.Event(), []
    real_read = cache.reader.read

    def held_read(*args, **kwargs):
        threads.append(threading.current_thread().name)
        assert release.wait(120)
        return real_read(*args, **kwargs)

    cache.reader.read = held_read
    try:
        engine.add_request("plain", "a blue square", SamplingParams(**dict(REQUEST, num_inference_steps=4)))
        finished = {o.request_id: o for o in engine.step() if o.finished}  # "plain" runs
        engine.add_request("styled", "a red circle", SamplingParams(**REQUEST, loras={"a": 1.0}))
        while "plain" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "styled" not in finished and finished["plain"].error is None and threads
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["styled"].error is None
        assert all(name.startswith("dvllm-lora-read") for name in threads), threads
    finally:
        release.set()
        engine.shutdown()
