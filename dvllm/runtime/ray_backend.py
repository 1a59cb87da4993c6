"""A remote whose process is a Ray actor (placed by its actor options: resources, a placement group's bundle): the
runtime's calls, pending answers, bounds, errors and restart, over Ray's tasks instead of a channel. Ray is
imported when a RayRemote is made, never by the runtime's other modules.

The actor is a RayHost: it builds its target ("module:Class", with its arguments) and answers each call with the
target's `handle(kind, payload)`, as a channel remote's target answers calls (calls.answer_calls); a PING and a
WHERE (the actor's node, pid and GPUs) it answers itself. Ray runs an actor's calls in order, so several may be in
flight. The target's exception comes back as RemoteError (its type's name, message and traceback); Ray's own
failures (the actor died, its node was lost, its worker crashed) and a call past its bound are the remote's loss
(`lost_error`). Unlike remote.py's Remote, nothing is started again on a loss: whoever owns the actor decides
when (a restart makes a new actor with the same options, in the same bundle).
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from dvllm.runtime.calls import PING
from dvllm.runtime.errors import ProcessLost, RemoteError
from dvllm.runtime.liveness import CallBounds
from dvllm.runtime.pending import Pending, time_left

logger = logging.getLogger(__name__)

WHERE = "where"  # a call the host answers with where it runs: node_ip, node_id, hostname, pid, gpu_ids
SETUP = "start"  # a call that sets the target up: its answer does not end the start bound (CallBounds.start_s)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("Ray workers need Ray: pip install 'dvllm[ray]'") from None
    return ray


class RayHost:
    """The actor's class (RayRemote wraps it with ray.remote)."""

    def __init__(self, target: str, args: Sequence[Any]) -> None:
        from dvllm.runtime.spawn import resolve

        self._target = resolve(target)(*args)

    def answer(self, kind: str, payload: Any) -> Any:
        if kind == PING:
            return None
        if kind == WHERE:
            return _where()
        try:
            return self._target.handle(kind, payload)
        except Exception as e:  # noqa: BLE001 - the caller decides what a failed call fails
            raise RemoteError.of(e) from None


def _where() -> dict[str, Any]:
    import ray

    return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


class RayRemote:
    """One Ray actor, named `label` in logs and errors ("worker 0"), hosting `target` built with `args`, made with
    Ray's actor `options` (kept for a restart). `bounds`: each call's bound (None: unbounded, a call's own `bound`
    aside), from its sending; a call past it kills the actor. Used by one thread at a time."""

    lost_error: type[ProcessLost] = ProcessLost

    def __init__(self, label: str, target: str, args: Sequence[Any] = (), options: dict[str, Any] | None = None,
                 bounds: CallBounds | None = None) -> None:
        self.ray = import_ray()
        self.label, self._target, self._args, self._options = label, target, tuple(args), dict(options or {})
        self.bounds = bounds
        self.restarts = 0
        self.timeouts = 0  # calls that passed their bound
        self.node: dict[str, Any] = {}  # where the actor runs: its latest WHERE answer
        self.actor: Any = None
        self._ids = itertools.count()
        self._calls: list[Pending] = []  # sent, not taken yet
        self._outcomes: dict[int, tuple[bool, Any]] = {}  # got from Ray, not taken yet: call -> (answered, value)
        self._lost_why: str | None = None
        self._answered = False
        self._start()

    @property
    def pid(self) -> int | None:
        return self.node.get("pid")

    @property
    def alive(self) -> bool:
        return self.actor is not None and self._lost_why is None

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def submit(self, kind: str, payload: Any, bound: float | None = None) -> Pending:
        """Sends a call; its answer comes in the Pending. Raises `lost_error` if the actor is lost."""
        if self._lost_why is not None:
            raise self.lost_error(self._lost_why)
        if bound is None and self.bounds is not None:
            bound = self.bounds.call_s if self._answered else self.bounds.start_s
        pending = Pending(self, next(self._ids), kind, bound, self.actor.answer.remote(kind, payload))
        self._calls.append(pending)
        return pending

    def call(self, kind: str, payload: Any) -> Any:
        """The actor's answer; raises its error (RemoteError) or `lost_error` (nothing is started again)."""
        return self.submit(kind, payload).result()

    def health(self) -> dict[str, Any]:
        """As Remote.health: pid, the oldest call in flight's age (None: idle) and bound, restarts, timeouts."""
        call = self._calls[0] if self._calls else None
        return {"pid": self.pid, "call_age_s": None if call is None else round(call.age, 3),
                "limit_s": None if call is None else call.bound, "restarts": self.restarts, "timeouts": self.timeouts}

    def kill(self, why: str = "was killed") -> None:
        """Ends the actor (it may live but be broken); its calls in flight are lost, saying `why`."""
        self._lost_why = self._lost_why or f"{self._named()} {why}"
        self._kill_actor()

    def restart(self) -> None:
        """Ends the actor if it lives and makes another with the same options (the same bundle); its calls in
        flight are lost. The new actor's set-up is the caller's to send."""
        why = self._lost_why or f"{self._named()} is replaced"
        self._kill_actor()
        self.restarts += 1
        logger.warning("%s; starting it again", why)
        self._start()

    def close(self) -> None:
        self._lost_why = self._lost_why or f"{self._named()} is closed"
        self._kill_actor()
        self.actor = None

    # -- pending answers (pending.py) ----------------------------------------------
    def _ready(self, pending: Pending) -> bool:
        if pending.incarnation != self.restarts or self._lost_why is not None or pending.id in self._outcomes:
            return True
        return self._expired(pending) or bool(self.ray.wait([pending.ref], timeout=0)[0])

    def _take(self, pending: Pending) -> Any:
        if pending.incarnation != self.restarts:
            raise self.lost_error(f"{self.label} was started again with call {pending.id} in flight")
        try:
            value = self._get(pending)
        finally:
            if pending in self._calls:
                self._calls.remove(pending)
        if pending.kind == WHERE:
            self.node = value
        elif pending.kind not in (SETUP, PING):
            self._answered = True
        return value

    def _get(self, pending: Pending) -> Any:
        while pending.id not in self._outcomes:
            if self._lost_why is not None and not self.ray.wait([pending.ref], timeout=0)[0]:
                raise self.lost_error(self._lost_why)  # (an answer that came before the loss is still taken)
            self._settle(pending, time_left(pending.deadline))
        answered, outcome = self._outcomes.pop(pending.id)
        if not answered:
            raise outcome
        return outcome

    def _settle(self, pending: Pending, timeout: float | None) -> None:
        """Gets the call's answer (or its error) within `timeout` into `_outcomes`; a loss marks the actor lost
        (so its other calls in flight are done too), a call past its bound kills it."""
        from ray.exceptions import GetTimeoutError, RayError, RayTaskError

        try:
            self._outcomes[pending.id] = (True, self.ray.get(pending.ref, timeout=timeout))
        except GetTimeoutError:
            self._expired(pending)
        except RayTaskError as e:  # the target raised
            self._outcomes[pending.id] = (False, remote_error(e))
        except RayError as e:  # the actor died, its node was lost, its worker crashed
            self._lost_why = self._lost_why or f"{self._named()} died: {first_line(e)}"
            self._outcomes[pending.id] = (False, self.lost_error(self._lost_why))

    def _expired(self, pending: Pending) -> bool:
        """Whether the call passed its bound: if so the actor is killed and lost."""
        if pending.deadline is None or time.monotonic() < pending.deadline:
            return False
        if self._lost_why is None:
            self.timeouts += 1
            self.kill(f"did not answer within {pending.bound:g} s (the bound of its call) and was killed")
        return True

    @staticmethod
    def _wait_any(pendings: list[Pending], timeout: float | None) -> list[Pending]:
        ray = import_ray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done: set[int] = set()
            waiting: dict[Any, Pending] = {}
            for p in pendings:
                remote: RayRemote = p.remote  # type: ignore[assignment]
                if p.incarnation != remote.restarts or remote._lost_why is not None or remote._expired(p):
                    done.add(id(p))
                else:
                    waiting[p.ref] = p
            if waiting:
                for ref in ray.wait(list(waiting), num_returns=len(waiting), timeout=0)[0]:
                    done.add(id(waiting[ref]))
                    waiting[ref].remote._settle(waiting[ref], 0)  # (a loss makes the actor's other calls done)
                done |= {id(p) for p in waiting.values() if p.remote._lost_why is not None}
            left = time_left(deadline)
            if done or left == 0:
                return [p for p in pendings if id(p) in done]
            # until one is answered, the timeout passes, or the earliest bound does (that call's actor is killed)
            expiry = min((p.deadline for p in waiting.values() if p.deadline is not None), default=None)
            waits = [s for s in (left, time_left(expiry)) if s is not None]
            ray.wait(list(waiting), num_returns=1, timeout=min(waits) if waits else None)

    # -- the rest -----------------------------------------------------------------
    def _kill_actor(self) -> None:
        if self.actor is None:
            return
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already, or its cluster is
            pass

    def _named(self) -> str:
        if not self.node:
            return self.label
        return f"{self.label} (pid {self.node['pid']} on {self.node['node_ip']})"

    def _start(self) -> None:
        self.actor = self.ray.remote(RayHost).options(**self._options).remote(self._target, self._args)
        self._calls.clear()
        self._outcomes.clear()
        self._lost_why, self._answered = None, False


def remote_error(error: BaseException) -> RemoteError:
    """The target's exception that a RayTaskError carries, as the runtime's RemoteError."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, RemoteError):
        return cause
    text = getattr(error, "traceback_str", "")
    if isinstance(cause, BaseException):
        return RemoteError(type(cause).__name__, str(cause), text)
    return RemoteError(type(error).__name__, first_line(error), text)


def first_line(error: BaseException) -> str:
    """Ray's error as "Type: its first line" (the rest is Ray's own context)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
