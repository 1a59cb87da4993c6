"""Where a remote runs: a process of its own (spawn.py), or a thread of this process (the in-process backend, for
tests whose subject is not the process boundary: the same channel and calls, none of a process's start-up)."""
from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Protocol, Sequence

from dvllm.runtime.channel import Channel
from dvllm.runtime.spawn import resolve, spawn


class Handle(Protocol):
    """What the caller holds of a remote: subprocess.Popen's pid, poll, wait, kill."""

    pid: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class Backend(Protocol):
    def start(self, target: str, name: str, args: Sequence[str], threads: int,
              env: dict[str, str] | None) -> tuple[Handle, Channel]: ...


class ProcessBackend:
    def start(self, target: str, name: str, args: Sequence[str], threads: int,
              env: dict[str, str] | None) -> tuple[Handle, Channel]:
        return spawn(target, name, args, threads, env)


class _Thread:
    """A remote on a thread: it ends when its target returns; kill closes its end of the channel, which ends a
    target waiting for its next call (one inside a call finishes it first: a thread cannot be killed)."""

    pid = None

    def __init__(self, target: str, name: str, args: Sequence[str], channel: Channel) -> None:
        self._channel = channel
        self._thread = threading.Thread(target=resolve(target), args=(channel, *args), name=name, daemon=True)
        self._thread.start()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self._thread.name, timeout)
        return 0

    def kill(self) -> None:
        import socket

        # (a shutdown wakes the thread blocked reading it; a close would not)
        try:
            with socket.socket(fileno=os.dup(self._channel.fileno())) as end:
                end.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass


class InProcessBackend:
    def start(self, target: str, name: str, args: Sequence[str], threads: int,
              env: dict[str, str] | None) -> tuple[Handle, Channel]:
        ours, theirs = multiprocessing.Pipe()  # (threads and env are the process's own: not the thread's to set)
        return _Thread(target, name, args, Channel(theirs)), Channel(ours)
