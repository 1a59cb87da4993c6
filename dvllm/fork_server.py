"""A fork server for dvllm's child processes: one fresh interpreter imports torch, diffusers and the children's
modules once, then forks a child for each start, instead of every child importing them again (about 5 s of CPU a
child on a 2-core machine: the engine core process, each encode and decode worker, each group member).

vLLM forks its workers from the engine itself while CUDA is not initialised. dvllm's processes hold threads by
the time they start children (a server's event loop, the stage threads), and a fork of a threaded process can
inherit a lock another thread held. The server is a process of one thread that has never touched CUDA (it checks
that libcuda is not loaded once its imports are done, and serves nothing otherwise): each child starts as a
fresh interpreter would, its imports done.

The first process that starts a child starts the server: the server's owner. The owner's children learn where it
listens (FORK_SERVER_ENV), so a core process's stage workers come from the same server. A child gets its
requester's stdin, stdout and stderr, the descriptors the requester passes (their numbers in the child come
first in its argv), its environment and its working directory. It dies with its requester (a thread watches
the requester's pid) and with the server (the kernel's parent-death signal), and the server dies with its
owner. The requester holds a ForkedChild: pid, poll, wait, kill, terminate, returncode (Popen's).

Where the server cannot start or serve, a child is a fresh interpreter (child_process.py), as it is with
DVLLM_FORK_SERVER=0.
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Sequence, Union

from dvllm.child_process import (
    DEATH_SIGNAL_ENV,
    PARENT_PID_ENV,
    PROCESS_NAME_ENV,
    child_command,
    child_env,
    die_with,
    run_entry,
    set_parent_death_signal,
    set_process_name,
)
from dvllm.forked_child import STATUS, ForkedChild
from dvllm.logging_setup import quiet_child_libraries

logger = logging.getLogger(__name__)

FORK_SERVER_ENV = "DVLLM_FORK_SERVER"  # "0": fresh interpreters; set by an owner for its children: the address
# What the server imports before it forks: every child's entry module (and the model registry: the pipelines
# and models each family loads, _preload)
PRELOAD = ("dvllm.runtime.spawn", "dvllm.engine.core_process", "dvllm.worker.decode_worker",
           "dvllm.worker.encode_worker", "dvllm.parallel.group_member", "dvllm.models.registry")
_MAX_MESSAGE = 1 << 20
_WATCH_S = 0.5
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass(frozen=True)
class _Request:
    entry: str          # "module:function", called with sys.argv = [entry, *fds as numbered in the child, *args]
    args: list[str]
    env: dict[str, str]
    cwd: str
    requester: int      # the pid the child dies with


Child = Union[subprocess.Popen, ForkedChild]  # what start_child returns


class ForkServerClient:
    """This process's connection to a server: one start at a time."""

    def __init__(self, address: str, process: subprocess.Popen | None) -> None:
        self.address, self.process = address, process  # process: the server, where this process owns it
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(_abstract(address))
        self._lock = threading.Lock()

    def start(self, entry: str, fds: Sequence[int], args: Sequence[str], env: dict[str, str], stdout: int,
              stderr: int) -> ForkedChild:
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = _Request(entry, list(args), {**env, FORK_SERVER_ENV: self.address}, os.getcwd(), os.getpid())
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            with self._lock:
                socket.send_fds(self._sock, [pickle.dumps(request)], [theirs.fileno(), stdin, stdout, stderr, *fds])
            data = status.recv(STATUS.size)
        finally:
            theirs.close()
            os.close(stdin)
        if len(data) != STATUS.size:
            status.close()
            raise OSError(f"the fork server did not start {entry}")
        return ForkedChild(entry, STATUS.unpack(data)[0], status)


def start_child(entry: str, name: str, fds: Sequence[int] = (), args: Sequence[str] = (),
                env_defaults: dict[str, str] | None = None, *, env: dict[str, str] | None = None,
                stdout: int | None = None, stderr: int | None = None) -> Child:
    """A child named `name` (its /proc/PID/comm) that runs `entry` ("module:function") with sys.argv[1:] =
    [*fds (as numbered in the child), *args], stdin from /dev/null, and dies with this process: forked by the fork
    server, or else a fresh interpreter (`python -m dvllm.child_process`). Its environment is `env_defaults` under
    `env` (this process's by default); its stdout and stderr are these descriptors (this process's by default)."""
    env = child_env({**(env_defaults or {}), PROCESS_NAME_ENV: name}, env)
    client = _client() if env.get(FORK_SERVER_ENV) != "0" else None
    if client is not None:
        try:
            return client.start(entry, fds, args, env, 1 if stdout is None else stdout, 2 if stderr is None else stderr)
        except OSError as e:  # (the server died: the next start asks for a new one)
            logger.warning("the fork server could not start %s (%s): starting it as a fresh interpreter", entry, e)
            with _CLIENT_LOCK:
                _connect.cache_clear()
    return subprocess.Popen(child_command(entry, *map(str, fds), *args), pass_fds=tuple(fds),
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env)


def _client() -> ForkServerClient | None:
    with _CLIENT_LOCK:  # (two threads starting children at once start one server)
        return _connect()


_CLIENT_LOCK = threading.Lock()


@functools.cache
def _connect() -> ForkServerClient | None:
    """This process's fork server: its parent's where it was started by one, else one it starts now; None where
    none can be had (it says why once)."""
    if not sys.platform.startswith("linux"):  # (abstract sockets, pidfds, the parent-death signal)
        return None
    address = os.environ.get(FORK_SERVER_ENV)
    try:
        if address:
            return ForkServerClient(address, None)
        return _start_server()
    except OSError as e:
        logger.warning("no fork server (%s): dvllm's child processes start as fresh interpreters", e)
        return None


def _start_server() -> ForkServerClient | None:
    address = f"dvllm-fork-server-{os.getpid()}-{secrets.token_hex(8)}"
    ready_r, ready_w = os.pipe()
    try:
        env = child_env({"OMP_WAIT_POLICY": "PASSIVE"})  # (stage workers' OpenMP threads sleep between batches)
        process = subprocess.Popen([sys.executable, "-m", "dvllm.fork_server", address, str(ready_w)],
                                   pass_fds=(ready_w,), stdin=subprocess.DEVNULL, env=env)
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            answer = ready.readline().decode().strip()
    except BaseException:
        os.close(ready_r)
        raise
    if answer != "ready":
        process.wait()
        logger.warning("the fork server does not serve (%s): dvllm's child processes start as fresh interpreters",
                       answer or f"it exited with code {process.returncode}")
        return None
    return ForkServerClient(address, process)


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _abstract(address: str) -> str:
    """A socket in Linux's abstract namespace: nothing left on disk when the server is killed."""
    return "\0" + address


# -- the server -------------------------------------------------------------------------------------------------
class _Server:
    def __init__(self, address: str) -> None:
        self.owner = os.getppid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(_abstract(address))
        self.listener.listen()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (status socket, pidfd)

    def serve(self) -> None:
        while os.getppid() == self.owner:
            for key, _ in self.selector.select(_WATCH_S):
                if key.data == "accept":
                    self._accept()
                elif key.data == "client":
                    self._read(key.fileobj)
                else:
                    self._reap(key.data)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():  # (an abstract socket has no file permissions: only this user's processes)
            conn.close()
            return
        self.selector.register(conn, selectors.EVENT_READ, "client")

    def _read(self, conn: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 64)
        except OSError:
            data, fds = b"", []
        if not data:  # that client is gone
            self.selector.unregister(conn)
            conn.close()
            _close(fds)
            return
        try:
            request: _Request = pickle.loads(data)
            if len(fds) < 4:
                raise ValueError(f"{len(fds)} descriptors, not the status socket, stdio and the child's")
        except Exception:  # noqa: BLE001 - a bad request fails that start only: its requester sees the socket close
            logger.exception("the fork server refused a request")
            _close(fds)
            return
        self._fork(request, fds)

    def _fork(self, request: _Request, fds: list[int]) -> None:
        status = socket.socket(fileno=fds[0])
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:  # (out of memory or processes): that start fails, the server serves on
            logger.exception("the fork server could not fork")
            status.close()
            _close(fds[1:])
            return
        if pid == 0:
            self._close_for_child(status)
            _run_child(request, fds[1:])  # (never returns)
        _close(fds[1:])
        try:
            status.sendall(STATUS.pack(pid))
        except OSError:
            pass  # its requester is gone: the child dies with it, and is reaped below
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (status, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)

    def _reap(self, pid: int) -> None:
        status, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, code = os.waitpid(pid, 0)
        try:
            status.sendall(STATUS.pack(os.waitstatus_to_exitcode(code)))
        except OSError:
            pass  # its requester is gone
        status.close()

    def _close_for_child(self, keep: socket.socket) -> None:
        """The server's descriptors, closed in a child (the requester's are its own)."""
        for key in list(self.selector.get_map().values()):
            obj = key.fileobj
            obj.close() if isinstance(obj, socket.socket) else os.close(obj)
        self.selector.close()
        self.listener.close()
        for status, _ in self.children.values():
            status.close()
        keep.close()


def _run_child(request: _Request, fds: list[int]) -> None:
    """In the forked child: the requester's stdio, descriptors, environment and directory; dies with the requester
    and with the server; then the entry, and the exit a fresh interpreter would make."""
    code = 1
    try:
        stdin, stdout, stderr, *passed = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        set_parent_death_signal()  # (the server's main thread: it forks every child)
        die_with(request.requester)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        for name in (PARENT_PID_ENV, DEATH_SIGNAL_ENV):  # (its own children get their own)
            os.environ.pop(name, None)
        _set_threads(os.environ.get("OMP_NUM_THREADS"))
        _extend_path(os.environ.get("PYTHONPATH", ""))
        code = run_entry(request.entry, [str(fd) for fd in passed] + request.args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as a fresh interpreter would: the traceback, exit code 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(_finish(code))


def _set_threads(value: str | None) -> None:
    """torch read OMP_NUM_THREADS when the server imported it: the child's own setting, as a fresh interpreter
    would read it."""
    import torch

    try:
        threads = int(value) if value else 0
    except ValueError:
        threads = 0
    if threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _extend_path(pythonpath: str) -> None:
    """The child's PYTHONPATH, which a fresh interpreter would have put before site-packages."""
    for entry in reversed([p for p in pythonpath.split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)  # (after sys.path[0], the directory the server started in)


def _finish(code: int) -> int:
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    return code


def _preload() -> None:
    import importlib

    import diffusers

    for module in PRELOAD:
        importlib.import_module(module)
    from dvllm.models.registry import ADAPTERS

    for adapter in ADAPTERS:  # (diffusers imports a pipeline's module, and its text encoders', when first named)
        for name in adapter.pipeline_classes:
            getattr(diffusers, name, None)


def _cuda_touched() -> bool:
    """Whether this process has loaded the CUDA driver: a fork after that is not safe."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def serve(argv: list[str]) -> None:
    """`python -m dvllm.fork_server ADDRESS READY_FD`: imports, says "ready" (or why not) on READY_FD, serves."""
    address, ready = argv[0], os.fdopen(int(argv[1]), "w")
    # A Ctrl-C or SIGTERM is the owner's to handle: it stops its children first, then goes, and this process
    # follows it. Blocked, not ignored: one sent to a child the moment it is forked waits for its own handlers.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    if os.environ.pop(DEATH_SIGNAL_ENV, "0") == "1":
        set_parent_death_signal()
    os.environ.pop(PARENT_PID_ENV, None)
    os.environ.pop(PROCESS_NAME_ENV, None)
    set_process_name("dvllm-fork")
    quiet_child_libraries()
    try:
        _preload()
        if _cuda_touched():
            raise RuntimeError("its imports loaded the CUDA driver, after which a fork is not safe")
        server = _Server(address)
    except Exception as e:  # noqa: BLE001 - said to the owner, which starts fresh interpreters instead
        ready.write(f"{type(e).__name__}: {e}\n")
        ready.close()
        return
    ready.write("ready\n")
    ready.close()
    server.serve()


if __name__ == "__main__":
    serve(sys.argv[1:])
