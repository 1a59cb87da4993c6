"""Answers to come: a call sent without waiting for its answer (`submit`, on a channel remote or a Ray one) gives a
Pending; several may be in flight on one remote (it answers them in order), and `wait` waits across the pending
answers of many remotes for whichever come first. A remote lost with calls in flight makes each of them done: its
`result` raises the remote's lost error. Taking answers, restarting and redoing are the caller's.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol


class Answering(Protocol):
    """What a Pending needs of its remote (remote.py's Remote, ray_backend.py's RayRemote)."""

    restarts: int

    def _ready(self, pending: Pending) -> bool: ...

    def _take(self, pending: Pending) -> Any: ...

    # (the pendings of remotes of its kind, a timeout) -> those done: how they are waited on together
    _wait_any: Callable[[list[Pending], float | None], list[Pending]]


class Pending:
    """One call's answer to come. `done()`: `result()` would not block (its answer, or its remote's loss, is
    there). `result()` blocks for the answer and gives it, or raises the remote's error (RemoteError) or its
    `lost_error` (the remote is not started again: that, and redoing the call, are the caller's)."""

    def __init__(self, remote: Answering, call_id: int, kind: str, bound: float | None, ref: Any = None) -> None:
        self.remote, self.id, self.kind, self.bound = remote, call_id, kind, bound
        self.sent = time.monotonic()
        self.incarnation = remote.restarts  # a restart loses the calls sent to the process before it
        self.ref = ref  # the backend's own handle of the answer (a Ray ObjectRef)

    @property
    def age(self) -> float:
        return time.monotonic() - self.sent

    @property
    def deadline(self) -> float | None:
        return None if self.bound is None else self.sent + self.bound

    def done(self) -> bool:
        return self.remote._ready(self)

    def result(self) -> Any:
        return self.remote._take(self)

    def __repr__(self) -> str:
        return f"Pending({self.kind!r}, call {self.id})"


def wait(pendings: Iterable[Pending], timeout: float | None = None) -> list[Pending]:
    """The pendings that are done, in the order given: at least one unless `timeout` seconds pass first (None: no
    limit; 0: those done now). They must be of one kind of remote (the channel's, or Ray's)."""
    pendings = list(pendings)
    if not pendings:
        return []
    waiters = {p.remote._wait_any for p in pendings}
    if len(waiters) > 1:
        raise ValueError("wait takes the pending answers of one kind of remote (channel or Ray), not a mix")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be None or >= 0, not {timeout}")
    return waiters.pop()(pendings, timeout)


def time_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic), not below 0; None for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
