"""dvllm's child processes (the engine core process, stage workers, group members) go when their parent goes, at
any stage of their start-up; and their libraries are as quiet on the stderr they share as their parent's.

Each is forked by the fork server (fork_server.py, which starts children with these same rules), or is a fresh
interpreter started as `python -m dvllm.child_process ENTRY ARGS...` (child_command), which first arranges to die
with its parent and only then runs ENTRY (run_entry): importing torch and loading a model take a minute, and a
parent killed meanwhile must not leave a child loading on, orphaned, holding memory or a GPU. Two mechanisms:

- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), the kernel's own, which acts even on a child stuck in C code. It fires
  when the *thread* that spawned the child ends, so it is asked for only when that was the parent's main thread.
- Everywhere: a daemon thread that waits for the parent's exit (a pidfd, else asking twice a second) and exits.

Both hold for the child's whole life (its pipe closing, each child's own rule for a stop, needs it to have started
reading the pipe; a dead parent leaves nobody to report to). A parent still starting up turns SIGTERM into an
exception (terminate_on_sigterm), so that it stops its children itself before it exits.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator

from dvllm.logging_setup import LIBRARY_LOGS_ENV, quiet_child_libraries

PARENT_PID_ENV = "DVLLM_PARENT_PID"
DEATH_SIGNAL_ENV = "DVLLM_PARENT_DEATH_SIGNAL"
PROCESS_NAME_ENV = "DVLLM_PROCESS_NAME"  # what `ps -o comm` and /proc/PID/comm show for a child: "dvllm-core", ...
_WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def child_command(entry: str, *args: str) -> list[str]:
    """The command line of a fresh interpreter that runs `entry` (run_entry) with `args` and dies with this
    process."""
    return [sys.executable, "-m", "dvllm.child_process", entry, *args]


def child_env(defaults: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `defaults` under `base` (this process's own by default), who its parent is, and
    whether the parent shows the libraries' logs."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    verbose = logging.getLogger("dvllm").isEnabledFor(logging.DEBUG)
    return {**(defaults or {}), **(os.environ if base is None else base), PARENT_PID_ENV: str(os.getpid()),
            DEATH_SIGNAL_ENV: "1" if on_main_thread else "0", LIBRARY_LOGS_ENV: "1" if verbose else "0"}


def die_with_parent() -> None:
    """In a child started with child_env: die when the parent does (the kernel's signal where it can, and a
    watching thread). Does nothing in a process started otherwise."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # (popped: the child's own children get their own)
    death_signal = os.environ.pop(DEATH_SIGNAL_ENV, "0") == "1"
    if parent is None:
        return
    parent_pid = int(parent)
    if death_signal:
        set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for: nobody would send it
        os._exit(1)
    die_with(parent_pid)


def set_parent_death_signal() -> None:
    """SIGKILL when the thread that started this process ends (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watching thread does it alone
        pass


def set_process_name(name: str) -> None:
    """The name `ps -o comm`, top and /proc/PID/comm show (Linux; 15 bytes at most)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def die_with(pid: int) -> None:
    """A daemon thread that ends this process once process `pid` has gone (its parent, or the process that asked
    the fork server for it)."""
    threading.Thread(target=_watch, args=(pid,), name="dvllm-parent-watch", daemon=True).start()


def _watch(pid: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # no pidfd here: ask now and then
        while _alive(pid):
            time.sleep(_WATCH_INTERVAL_S)
        os._exit(1)
    select.select([pidfd], [], [])  # (readable once the process has exited)
    os._exit(1)  # nobody is left to report to; atexit and threads would only delay it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run_entry(entry: str, argv: list[str]) -> int:
    """Runs a child's `entry` with sys.argv[1:] = argv: "module:function" calls the function (its module imported
    under its own name, so that what it pickles unpickles in the parent), "module" runs as `python -m module`."""
    import importlib
    import runpy

    module, _, function = entry.partition(":")
    sys.argv = [module, *argv]
    name = os.environ.pop(PROCESS_NAME_ENV, None)
    if name:
        set_process_name(name)
    if not function:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    code = getattr(importlib.import_module(module), function)()
    return code if isinstance(code, int) else 0


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
    die_with_parent()
    quiet_child_libraries()  # before the module's imports, which load torchao (its "Failed to load ..." lines)
    sys.exit(run_entry(sys.argv[1], sys.argv[2:]))
