"""dvllm's child processes (the engine core process, stage workers, group members) go when their parent goes, at
any stage of their start-up; and their libraries are as quiet on the stderr they share as their parent's.

Each is a fresh interpreter started as `python -m dvllm.child_process MODULE ARGS...` (child_command), which first
arranges to die with its parent and only then runs MODULE as `python -m MODULE ARGS...` would: importing torch and
loading a model take a minute, and a parent killed meanwhile must not leave a child loading on, orphaned, holding
memory or a GPU. Two mechanisms:

- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), the kernel's own, which acts even on a child stuck in C code. It fires
  when the *thread* that spawned the child ends, so it is asked for only when that was the parent's main thread.
- Everywhere: a daemon thread that checks the parent's pid twice a second and exits once the child has been
  re-parented.

Both hold for the child's whole life (its pipe closing, each child's own rule for a stop, needs it to have started
reading the pipe; a dead parent leaves nobody to report to). A parent still starting up turns SIGTERM into an
exception (terminate_on_sigterm), so that it stops its children itself before it exits.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from dvllm.entrypoints.logging_setup import LIBRARY_LOGS_ENV, quiet_child_libraries

PARENT_PID_ENV = "DVLLM_PARENT_PID"
DEATH_SIGNAL_ENV = "DVLLM_PARENT_DEATH_SIGNAL"
_WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


def child_command(module: str, *args: str) -> list[str]:
    """The command line of a child that runs `python -m module args...` and dies with this process."""
    return [sys.executable, "-m", "dvllm.child_process", module, *args]


def child_env(defaults: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `defaults` under this process's own, who its parent is, and whether the parent
    shows the libraries' logs."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    verbose = logging.getLogger("dvllm").isEnabledFor(logging.DEBUG)
    return {**(defaults or {}), **os.environ, PARENT_PID_ENV: str(os.getpid()),
            DEATH_SIGNAL_ENV: "1" if on_main_thread else "0", LIBRARY_LOGS_ENV: "1" if verbose else "0"}


def die_with_parent() -> None:
    """In a child started with child_env: die when the parent does (the kernel's signal where it can, and a
    watching thread). Does nothing in a process started otherwise."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # (popped: the child's own children get their own)
    death_signal = os.environ.pop(DEATH_SIGNAL_ENV, "0") == "1"
    if parent is None:
        return
    parent_pid = int(parent)
    if death_signal and sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for: nobody would send it
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="dvllm-parent-watch", daemon=True).start()


def _set_parent_death_signal(sig: int) -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watching thread does it alone
        pass


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_INTERVAL_S)
    os._exit(1)  # nobody is left to report to; atexit and threads would only delay it


class Terminated(BaseException):
    """SIGTERM reached a command before it had a graceful stop of its own (loading, or generating offline); a
    BaseException, as KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Within it, SIGTERM raises Terminated in the main thread, so that what is starting (a core process, stage
    processes) is stopped on the way out instead of the process vanishing at once. A server replaces the handler
    with its own graceful one once it serves. Does nothing off the main thread (no signal handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    import runpy

    die_with_parent()
    quiet_child_libraries()  # before the module's imports, which load torchao (its "Failed to load ..." lines)
    module = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]  # what `python -m module args...` would see (argv[0] set by runpy)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
