"""The fork server (dvllm/fork_server.py): a child it forks gets what a fresh interpreter would (its descriptors and
argv, stdout and stderr, environment, working directory, thread count, name, exit code), in a fraction of the
time; it dies with the process that asked for it, and everything dies with the server's owner.
DVLLM_FORK_SERVER=0 gives fresh interpreters, the same way."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_tree import children_of, process_name, zombie

from dvllm.fork_server import ForkedChild, start_child

TESTS = str(Path(__file__).parent)
WAIT = 120.0


def _wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT  # (reached only when something is broken)
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


@pytest.mark.parametrize("fork_server", ["on", "off"])
def test_a_child_gets_what_a_fresh_interpreter_would(fork_server, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("FORK_TEST_MARKER", "from the parent")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    if fork_server == "off":
        monkeypatch.setenv("DVLLM_FORK_SERVER", "0")
    monkeypatch.chdir(tmp_path)
    read, write = os.pipe()
    child = start_child("fork_child:report", "fork-report", [write], ["a", "b c"])
    os.close(write)
    facts = json.loads(_read_all(read))
    assert child.wait(WAIT) == 3 and child.poll() == 3 and child.returncode == 3
    assert isinstance(child, ForkedChild if fork_server == "on" else subprocess.Popen)
    assert facts["argv"] == ["a", "b c"] and facts["marker"] == "from the parent"
    assert facts["cwd"] == str(tmp_path) and facts["comm"] == "fork-report" and facts["threads"] == 2
    if fork_server == "on":  # forked by this process's server, not by this process
        assert facts["ppid"] != os.getpid() and process_name(facts["ppid"]) == "dvllm-fork"
        assert facts["ppid"] in children_of(os.getpid())
    out, err = capfd.readouterr()
    assert "to stdout" in out and "to stderr" in err


def test_wait_times_out_and_kill_ends_it(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    child = start_child("fork_child:sleep", "fork-sleep")
    assert isinstance(child, ForkedChild)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.kill()
    assert child.wait(WAIT) == -signal.SIGKILL
    child.kill()  # (once it is gone: nothing, as Popen)
    child = start_child("fork_child:sleep", "fork-sleep")
    child.terminate()
    assert child.wait(WAIT) == -signal.SIGTERM


OWNER = """
import os, sys, time
from dvllm.fork_server import start_child
read, write = os.pipe()
middle = start_child("fork_child:spawn_and_sleep", "fork-middle", [write])
os.close(write)
grandchild = int(os.read(read, 64).decode())
other = start_child("fork_child:sleep", "fork-other")
print(middle.pid, grandchild, other.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_children_die_with_who_asked_for_them_and_all_with_the_owner():
    """A child's own child (asked of the same server) dies with it; the owner's death ends the server and every
    child it forked."""
    env = {**os.environ, "PYTHONPATH": TESTS}
    env.pop("DVLLM_FORK_SERVER", None)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, env=env)
    try:
        middle, grandchild, other = map(int, owner.stdout.readline().split())
        # (a child names itself once forked, maybe after its pid reached who asked for it)
        _wait_for(lambda: process_name(grandchild) == "fork-grandchild" and process_name(middle) == "fork-middle",
                  "the children to name themselves")
        (server,) = [p for p in children_of(owner.pid) if process_name(p) == "dvllm-fork"]
        os.kill(middle, signal.SIGKILL)
        _wait_for(lambda: zombie(grandchild), "the grandchild to die with the child that asked for it")
        assert not zombie(other) and not zombie(server)
        owner.kill()
        owner.wait()
        _wait_for(lambda: zombie(server) and zombie(other), "the server and its children to die with the owner")
    finally:
        owner.kill()
        owner.wait()


def test_a_bad_request_fails_alone_and_the_server_serves_on(monkeypatch):
    """A request the server cannot read (not a pickle, too few descriptors) is refused; the server and the children
    it forked before go on, and the next start is forked as usual."""
    import socket

    from dvllm import fork_server

    monkeypatch.setenv("PYTHONPATH", TESTS)
    before = start_child("fork_child:sleep", "fork-sleep")
    assert isinstance(before, ForkedChild)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect("\0" + fork_server._client().address)
        sock.send(b"not a request")
        devnull = os.open(os.devnull, os.O_RDONLY)
        socket.send_fds(sock, [b"still not a request"], [devnull])
        os.close(devnull)
    after = start_child("fork_child:sleep", "fork-sleep")
    assert isinstance(after, ForkedChild) and before.poll() is None and after.poll() is None
    for child in (before, after):
        child.kill()
        assert child.wait(WAIT) == -signal.SIGKILL
