"""Calls over a channel: each names its kind and carries an id its answer repeats; an answer holds a value or the
error the call raised there (errors.py). A None message asks the answering side to stop; a PING is answered at
once (by the runtime, not the handler: the heartbeat of an idle remote, liveness.IdlePings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dvllm.runtime.errors import RemoteError

if TYPE_CHECKING:  # (not imported: the channel needs torch, which the runtime's light users do without)
    from dvllm.runtime.channel import Channel

PING = "ping"


@dataclass(frozen=True)
class Call:
    id: int
    kind: str
    payload: Any


@dataclass(frozen=True)
class Answer:
    id: int
    value: Any = None
    error: RemoteError | None = None


def answer_calls(channel: Channel, handle: Callable[[str, Any], Any]) -> None:
    """Answers each call with `handle(kind, payload)` until told to stop or the caller is gone."""
    while True:
        try:
            call = channel.receive()
        except (EOFError, OSError):
            return
        if call is None:
            return
        try:
            answer = Answer(call.id, None if call.kind == PING else handle(call.kind, call.payload))
        except Exception as e:  # noqa: BLE001 - the caller decides what a failed call fails
            answer = Answer(call.id, error=RemoteError.of(e))
        try:
            channel.send(answer)
        except (OSError, ValueError):
            return
