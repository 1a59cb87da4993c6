"""The handle of a child the fork server forked (fork_server.py), as subprocess.Popen is a fresh one's: pid, poll,
wait, kill, terminate, returncode. The child is the server's, not this process's: its exit status comes from the
server over a socket of its own, and signals go through a pidfd, so a pid the server has reaped (and the kernel
may give to another process) is never signalled."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import threading

STATUS = struct.Struct("q")  # a pid once forked, then the exit code (Popen's: -N for signal N)


class ForkedChild:
    """A child the server forked, as subprocess.Popen shows a child: the server reports its exit status."""

    def __init__(self, entry: str, pid: int, status: socket.socket) -> None:
        self.args, self.pid, self._status = entry, pid, status
        self.returncode: int | None = None
        self._lock = threading.Lock()  # (one reader of the status: a poll and a wait may race for it)
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already (its status is on the way), or no pidfd here
            self._pidfd = None

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self._read_status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):  # another thread reads it
            return self.returncode
        try:
            if self.returncode is None:
                self._receive(timeout)
            return self.returncode
        finally:
            self._lock.release()

    def _receive(self, timeout: float | None) -> None:
        self._status.settimeout(timeout)
        try:
            data = self._status.recv(STATUS.size)
        except (TimeoutError, BlockingIOError, socket.timeout):
            return
        except OSError:
            data = b""
        # no status: the server is gone, and the kernel killed its children with it
        self.returncode = STATUS.unpack(data)[0] if len(data) == STATUS.size else -signal.SIGKILL
        self._status.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
