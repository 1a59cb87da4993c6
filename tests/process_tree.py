"""dvllm's processes as /proc shows them (Linux). A child is forked by its owner's fork server (dvllm/fork_server.py),
so it is a descendant of the process that started it, not always a child: tests find dvllm's processes by the name
each is given (/proc/PID/comm: dvllm-core, dvllm-decode, dvllm-encode, dvllm-member; dvllm-fork for the server)."""
from __future__ import annotations

import os


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def dvllm_processes(pid: int, name: str) -> list[int]:
    """The live processes named `name` that `pid` started, itself or through the processes it started."""
    return [p for p in descendants(pid) if process_name(p) == name and not zombie(p)]


def zombie(pid: int) -> bool:
    """Exited (or gone): a zombie waits for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
