"""dvllm's runtime's pending answers (runtime/pending.py): several calls in flight on one remote answer in order,
`wait` across remotes gives the ones done (none once its timeout passes), a lost remote's pending answers raise its
lost error, idle remotes are pinged (liveness.IdlePings); and the same over a Ray actor (runtime/ray_backend.py)."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from dvllm.runtime.backends import InProcessBackend
from dvllm.runtime.errors import ProcessLost, RemoteError
from dvllm.runtime.liveness import IdlePings
from dvllm.runtime.pending import wait
from dvllm.runtime.remote import Remote

TESTS = str(Path(__file__).parent)


@pytest.fixture
def tests_importable(monkeypatch):
    """The children (processes, Ray's workers) import the targets from tests/, and dvllm from where this one does."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
def gate():
    gate = threading.Event()
    yield gate
    gate.set()  # (a thread still held at the gate ends)


def test_calls_in_flight_answer_in_order_and_wait_gives_those_done(gate):
    held = Remote("held remote", "runtime_targets:gated", "dvllm-test", [gate], backend=InProcessBackend())
    free = Remote("free remote", "runtime_targets:answer", "dvllm-test", backend=InProcessBackend())
    try:
        first, second, failing = held.submit("gated", 1), held.submit("echo", 2), held.submit("fail", "x")
        other = free.submit("echo", 3)
        assert held.in_flight == 3 and held.health()["call_age_s"] is not None
        assert wait([first, second, failing, other]) == [other]  # the held remote answers in order: none of its
        assert wait([first, second], timeout=0.01) == []  # the timeout passes with none done
        assert not first.done() and other.result() == 3
        gate.set()
        assert first in wait([second, first])
        assert (first.result(), second.result()) == (1, 2)
        with pytest.raises(RemoteError, match="KeyError: 'x'"):
            failing.result()
        assert held.in_flight == 0 and held.health()["call_age_s"] is None
        assert held.call("echo", 4) == 4 and wait([], timeout=0) == []
        with pytest.raises(ValueError, match="timeout"):
            wait([held.submit("echo", 5)], timeout=-1)
    finally:
        held.close()
        free.close()


def test_a_lost_remotes_pending_answers_raise_its_lost_error(tests_importable):
    remote = Remote("test remote", "runtime_targets:answer", "dvllm-test")
    try:
        asleep, behind = remote.submit("sleep", 600), remote.submit("echo", 1)
        pid = remote.pid
        os.kill(pid, signal.SIGKILL)
        assert wait([asleep, behind]) == [asleep, behind]  # done: each raises the loss
        for pending in (asleep, behind):
            with pytest.raises(ProcessLost, match=rf"test remote \(pid {pid}\) (exited|died)"):
                pending.result()
        with pytest.raises(ProcessLost):  # lost until started again: nothing more is sent
            remote.submit("echo", 2)
        remote.restart()
        with pytest.raises(ProcessLost, match="started again"):
            asleep.result()
        assert remote.submit("echo", 3).result() == 3 and remote.restarts == 1 and remote.pid != pid
    finally:
        remote.close()


def test_idle_pings_find_a_dead_idle_remote_and_leave_busy_ones_alone(tests_importable, gate):
    idle = Remote("idle remote", "runtime_targets:answer", "dvllm-test")
    dead = Remote("dead remote", "runtime_targets:answer", "dvllm-test")
    busy = Remote("busy remote", "runtime_targets:gated", "dvllm-test", [gate], backend=InProcessBackend())
    pings = IdlePings(limit_s=60)
    try:
        step = busy.submit("gated", 1)
        os.kill(dead.pid, signal.SIGKILL)
        dead.process.wait()  # (reaped: its channel's end is closed)
        lost = pings.check({"idle": idle, "dead": dead, "busy": busy}, busy={"busy"})
        assert list(lost) == ["dead"] and "dead remote" in lost["dead"]
        assert busy.in_flight == 1  # not pinged: its step is what proves it
        assert idle.call("echo", 0) == 0  # (answered after the ping sent to it, which is answered then too)
        assert pings.check({"idle": idle, "busy": busy}, busy={"busy"}) == {}  # taken: nothing to say
        gate.set()
        assert step.result() == 1
        with pytest.raises(ValueError, match="bound"):
            IdlePings(limit_s=0)
    finally:
        for remote in (idle, dead, busy):
            remote.close()


@pytest.mark.slow
def test_a_ray_actor_is_a_remote(tests_importable):
    """The Ray backend on a local Ray: calls in flight answer in order, the target's error comes back as
    RemoteError, a killed actor's pending answers raise the loss, a call past its bound kills the actor, and a
    restart makes a new actor."""
    ray = pytest.importorskip("ray")
    from dvllm.runtime.ray_backend import WHERE, RayRemote

    assert not ray.is_initialized()
    ray.init(include_dashboard=False, logging_level="WARNING", num_cpus=1)
    remote = RayRemote("test actor", "runtime_targets:Answerer", options={"num_cpus": 0})
    try:
        where, echo, failing = remote.submit(WHERE, None), remote.submit("echo", 1), remote.submit("fail", "x")
        assert wait([where, echo, failing]) and echo.result() == 1
        assert where.result()["pid"] == remote.pid != os.getpid()
        with pytest.raises(RemoteError, match="KeyError: 'x'") as raised:
            failing.result()
        assert "_handle" in raised.value.remote_traceback
        asleep, behind = remote.submit("sleep", 600), remote.submit("echo", 2)
        assert wait([asleep, behind], timeout=0) == []
        ray.kill(remote.actor, no_restart=True)
        assert wait([asleep, behind]) == [asleep, behind]
        with pytest.raises(ProcessLost, match=rf"test actor \(pid {remote.pid} on [\d.]+\) died: \w+Error"):
            behind.result()
        remote.restart()
        assert remote.call("echo", 3) == 3 and remote.restarts == 1
        with pytest.raises(ProcessLost, match="did not answer within 0.5 s"):
            remote.submit("sleep", 600, bound=0.5).result()
        assert remote.timeouts == 1 and not remote.alive
    finally:
        remote.close()
        ray.shutdown()
