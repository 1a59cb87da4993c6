"""Entries for tests/test_fork_server.py's children (run through dvllm.child_process.run_entry)."""
from __future__ import annotations

import json
import os
import sys
import time


def report() -> int:
    """Writes what it was given to the descriptor in argv[1], a line to stdout and to stderr; exits 3."""
    import torch

    with open(f"/proc/{os.getpid()}/comm") as f:
        comm = f.read().strip()
    facts = {"argv": sys.argv[2:], "cwd": os.getcwd(), "marker": os.environ.get("FORK_TEST_MARKER"), "comm": comm,
             "ppid": os.getppid(), "threads": torch.get_num_threads()}
    os.write(int(sys.argv[1]), json.dumps(facts).encode())
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return 3


def sleep() -> None:
    time.sleep(600)


def spawn_and_sleep() -> None:
    """Starts a `sleep` child of its own, writes its pid to the descriptor in argv[1], sleeps."""
    from dvllm.fork_server import start_child

    child = start_child("fork_child:sleep", "fork-grandchild")
    os.write(int(sys.argv[1]), f"{child.pid}\n".encode())
    time.sleep(600)
