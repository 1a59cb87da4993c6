"""Targets for tests/test_runtime.py's remotes (run by dvllm.runtime.spawn, or on a thread)."""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from dvllm.runtime.calls import answer_calls
from dvllm.runtime.channel import Channel


def _handle(kind: str, payload: Any) -> Any:
    if kind == "echo":
        return payload
    if kind == "facts":
        return {"pid": os.getpid(), "threads": torch.get_num_threads()}
    if kind == "fail":
        raise KeyError(payload)
    if kind == "sleep":
        time.sleep(payload)
        return None
    if kind == "exit":
        os._exit(payload)
    raise ValueError(f"no call {kind!r}")


def answer(channel: Channel) -> None:
    answer_calls(channel, _handle)


def gated(channel: Channel, gate: Any) -> None:
    """As `answer`, and a "gated" call answers its payload once `gate` (a threading.Event: the in-process backend
    only) is set."""

    def handle(kind: str, payload: Any) -> Any:
        if kind == "gated":
            gate.wait()
            return payload
        return _handle(kind, payload)

    answer_calls(channel, handle)


class Answerer:
    """A Ray actor's target (runtime.ray_backend): the same calls."""

    def handle(self, kind: str, payload: Any) -> Any:
        return _handle(kind, payload)
