"""dvllm's runtime (dvllm/runtime/): the channel carries messages and their tensors whole (a tensor named twice
arrives as one), a remote answers calls in a process of its own or on a thread, its errors come back with their
type's name and traceback, and a remote that dies or passes its call's bound is started again."""
from __future__ import annotations

import os
import signal
import threading
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from dvllm.runtime.backends import InProcessBackend
from dvllm.runtime.channel import Channel
from dvllm.runtime.errors import ProcessLost, RemoteError
from dvllm.runtime.liveness import CallBounds
from dvllm.runtime.remote import Remote

TESTS = str(Path(__file__).parent)
TARGET = "runtime_targets:answer"


@pytest.fixture
def tests_importable(monkeypatch):
    """The children import the targets from tests/, and dvllm from where this process does."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def test_the_channel_carries_tensors_whole_and_a_tied_one_once():
    ours, theirs = Pipe()
    a, b = Channel(ours), Channel(theirs)
    weight = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    message = {"tied": [weight, weight], "view": weight[1:, ::2], "empty": torch.zeros(0, 5),
               "scalar": torch.tensor(True), "conj": torch.tensor([1 + 2j]).conj(), "param": torch.nn.Parameter(torch.ones(2)), "text": "x" * 10}
    got: list = []
    reader = threading.Thread(target=lambda: got.append(b.receive()))
    reader.start()
    a.send(message)
    reader.join()
    (out,) = got
    assert out["tied"][0] is out["tied"][1] and torch.equal(out["tied"][0], weight)
    assert out["tied"][0].dtype == torch.bfloat16 and torch.equal(out["view"], weight[1:, ::2])
    assert out["empty"].shape == (0, 5) and out["scalar"].item() is True and out["conj"].item() == 1 - 2j
    assert isinstance(out["param"], torch.nn.Parameter) and out["text"] == "x" * 10
    a.close()
    with pytest.raises((EOFError, OSError)):
        b.receive()


@pytest.mark.parametrize("backend", ["process", "in-process"])
def test_a_remote_answers_and_its_errors_come_back_named(backend, tests_importable):
    remote = Remote("test remote", TARGET, "dvllm-test", threads=1,
                    backend=InProcessBackend() if backend == "in-process" else None)
    try:
        payload = {"latents": torch.randn(2, 4, 8, 8)}
        assert torch.equal(remote.call("echo", payload)["latents"], payload["latents"])
        with pytest.raises(RemoteError, match="KeyError: 'missing'") as raised:
            remote.call("fail", "missing")
        assert raised.value.type_name == "KeyError" and "_handle" in raised.value.remote_traceback
        facts = remote.call("facts", None)
        if backend == "process":
            assert facts["pid"] == remote.pid != os.getpid() and facts["threads"] == 1
        assert remote.health()["call_age_s"] is None and remote.restarts == 0
    finally:
        remote.close()


def test_a_remote_that_dies_is_started_again(tests_importable):
    remote = Remote("test remote", TARGET, "dvllm-test")
    try:
        first = remote.pid
        with pytest.raises(ProcessLost, match=rf"test remote \(pid {first}\) (exited|died)"):
            remote.call("exit", 3)
        assert remote.restarts == 1 and remote.pid != first and remote.call("echo", 5) == 5
        os.kill(remote.pid, signal.SIGKILL)  # idle: the next call finds it gone
        remote.process.wait()
        with pytest.raises(ProcessLost):
            remote.call("echo", 6)
        assert remote.restarts == 2 and remote.call("echo", 7) == 7
    finally:
        remote.close()


def test_a_call_past_its_bound_kills_the_remote(tests_importable):
    remote = Remote("test remote", TARGET, "dvllm-test")
    remote.bounds = CallBounds(call_s=0.5, start_s=60.0)
    try:
        assert remote.call("echo", 1) == 1  # answered: later calls have call_s
        first = remote.pid
        with pytest.raises(ProcessLost, match="did not answer within 0.5 s"):
            remote.call("sleep", 600)
        assert (remote.restarts, remote.timeouts) == (1, 1) and remote.pid != first
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(first, 0)
    finally:
        remote.close()
