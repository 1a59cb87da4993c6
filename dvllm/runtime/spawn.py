"""A process of dvllm's own, and the channel to it: forked by the fork server, or a fresh interpreter (never a fork
of a process that holds CUDA or threads, and not multiprocessing's spawn, which imports the caller's main script
again); it dies with its parent, even while it starts (fork_server.py, child_process.py).

The child runs `child_main`, which makes it a quiet, Ctrl-C-proof child with the torch thread count it was given,
then calls its target ("module:function") with the channel and the target's own arguments.
"""
from __future__ import annotations

import importlib
import multiprocessing
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from dvllm.fork_server import Child, start_child
from dvllm.runtime.channel import Channel

# (the channel, the target's arguments) -> None: what a process runs, as "module:function"
Target = Callable[..., None]
_CHILD_MAIN = "dvllm.runtime.spawn:child_main"


def spawn(target: str, name: str, args: Sequence[str] = (), threads: int = 0,
          env: dict[str, str] | None = None) -> tuple[Child, Channel]:
    """A process named `name` (its /proc/PID/comm) that runs `target` with (its end of the channel, *args) and
    `threads` torch threads (0: torch's default), with `env` under this process's environment."""
    parent, child = multiprocessing.Pipe()
    try:
        process = start_child(_CHILD_MAIN, name, [child.fileno()], [target, str(threads), *args], env)
    finally:
        child.close()  # the child's end lives in the child alone: its death ends the channel
    return process, Channel(parent)


def resolve(target: str) -> Target:
    module, _, function = target.partition(":")
    if not function:
        raise ValueError(f"a process target is 'module:function', not {target!r}")
    return getattr(importlib.import_module(module), function)


def use_threads(threads: int) -> None:
    """This process's torch intra-op threads (0: torch's default). Set once, at the start: besides the OpenMP
    count it resizes process-wide pools other threads may be using."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def child_main() -> None:
    """The process's entry (dvllm.child_process.run_entry): sys.argv[1:] = `<channel fd> <target> <threads>
    <the target's arguments>`."""
    from dvllm.logging_setup import child_library_logs, set_third_party_verbosity

    fd, target, threads, *args = sys.argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle: it stops us
    set_third_party_verbosity(verbose=child_library_logs())  # (its stderr is its parent's: no loading bars there)
    use_threads(int(threads))
    run: Any = resolve(target)
    run(Channel(Connection(int(fd))), *args)
