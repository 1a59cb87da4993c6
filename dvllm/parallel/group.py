"""A worker group: the worker and `group_size - 1` member processes of its own run every denoiser forward
together, each on its own device with a whole copy of the denoiser, and either a slice of every row's tokens
(sequence parallel: diffusers' context parallelism, parallel/context_parallel.py) or a slice of the rows
(CFG-parallel: parallel/row_split.py).

The worker leads. It alone holds the requests' state, schedules, samples and decodes; a member holds the denoiser
and nothing else. Each time the worker calls its denoiser, a hook sends the call to the members first (its
arguments' skeleton over each member's channel, its tensors by broadcast: parallel/call_broadcast.py), so every
member makes the same call. Sequence parallel: the collectives inside the forward split and gather, and every
member ends with the whole output, of which the worker's is used. CFG-parallel: each runs its own rows and the
worker receives the others'. So batching, samplers, preemption and every request's state are the one worker's as
before: only the forward is shared.

LoRA: the members hold the worker's adapter slots (their denoiser layers), loaded as the worker loads them, and
each call names its rows' adapters by slot; a CFG-parallel call's rows are cut with them, the worker's own slice
run in a narrowed row scope (worker/row_scope.py), as step caching narrows.

Step caching: a forward with cached rows runs on the worker alone (the split paused), since its per-row skip
decisions read each row's whole tokens and its state lives in the worker's pool; the rest go on splitting.

A member holds nothing else between calls (its slots are the worker's, sent again), so losing one loses nothing:
a forward that fails while a member is dead (or with a collective's error) forms the group anew (every member
started again, the process group made again) and runs again. A forward is a pure function of its inputs, so
running it again changes no image.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from dvllm.lora.ref import LoraRef
from dvllm.parallel.call_broadcast import pack, send_tensors
from dvllm.parallel.context_parallel import (
    check_context_parallel,
    context_parallel_paused,
    enable_context_parallel,
    rejoin_context_parallel,
    rows_split_pays,
)
from dvllm.parallel.group_decode import DecodeCalls, assign
from dvllm.parallel.group_member import JoinOrder, LoraSlot, SharedCall, backend
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.parallel.row_split import call_rows, chunk, cut, gather_rows
from dvllm.parallel.uneven_split import TooFewTokens
from dvllm.runtime.liveness import CallBounds
from dvllm.runtime.remote import SETUP
from dvllm.worker.forward_context import ForwardContext
from dvllm.worker.stage_process import StageProcess, WorkerProcessLost, check_devices

logger = logging.getLogger(__name__)


class GroupMember(StageProcess):
    kind = "group member"
    target = "dvllm.parallel.group_member:main"
    process_name = "dvllm-member"

    def load(self) -> None:
        """Sends the engine's config: the member loads the model (its answer comes later: `loaded`)."""
        self.post(SETUP, self._copy())

    def loaded(self) -> None:
        self.receive()
        self._built = True

    def send(self, message: Any) -> None:
        """A JoinOrder, or a denoiser call's skeleton; `done` waits for its end."""
        self.post("run", message)

    def done(self) -> Any:
        """The member's answer to what was sent last (a DecodeCalls' outputs; None for the rest)."""
        return self.receive()

    def start_again(self) -> None:
        self.restart("died" if not self.alive else "goes with its group, formed anew")


def member_devices(config: ParallelConfig, device: torch.device) -> list[str]:
    """Where the members go: --group-devices, else the worker's device type (a GPU worker's members on the GPUs
    after its own)."""
    if config.devices:
        return list(config.devices)
    count = config.size - 1
    if device.type != "cuda":
        return ["cpu"] * count
    first = (device.index if device.index is not None else torch.cuda.current_device()) + 1
    return [f"cuda:{first + i}" for i in range(count)]


class WorkerGroup:
    """The leader's side of a group: its members, the process group, and the hook that shares each call."""

    def __init__(self, config: ParallelConfig, engine_config: Any, denoisers: list[torch.nn.Module],
                 device: torch.device) -> None:
        """`engine_config`: the flat EngineConfig the members load the model from; `denoisers`: the worker's
        (a two-expert model's both, each call shared with the expert it runs)."""
        self.size, self.ring = config.size, config.ring_degree
        self.splits_tokens = config.sequence_parallel_size > 1  # the denoiser has the context-parallel plan on
        self.elastic = config.elastic  # the split chosen per step (choose_split)
        # Row groups: runs of consecutive ranks, each running a slice of a call's rows (its ranks splitting the
        # tokens between them). Static: cfg_parallel_size of sequence_parallel_size ranks each. Elastic: this step's
        # choice, every rank its own rows (the split paused) or one group that splits every row's tokens.
        self.cfg_groups = config.cfg_parallel_size
        self.row_groups = self.cfg_groups
        self.forwards = {"tokens": 0, "rows": 0, "alone": 0}  # denoiser calls, by split (alone: not shared)
        # The running forward's context, given to the group's call hooks for its span as to every hook (the worker
        # adds the group to its ForwardHooks): its LoRA rows and its step caching
        self.context: ForwardContext | None = None
        self._alone = False
        if self.splits_tokens:
            for denoiser in denoisers:
                check_context_parallel(denoiser, config.sequence_parallel_size // self.ring, self.ring, device)
        devices = member_devices(config, device)
        if len(devices) != self.size - 1:
            raise ValueError(f"a group of {self.size} needs {self.size - 1} member devices, got {devices}")
        _check_member_devices(devices, device)
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group; a process leads one worker "
                             "group (run another engine in a process of its own)")
        self.config, self.denoisers, self.device = config, denoisers, device
        self.denoiser = denoisers[0]
        self.restarts = 0  # times the group was formed anew
        # One exchange with the members at a time: the step loop's forwards and the decode stage's decodes
        self.lock = threading.Lock()
        self.units_decoded = [0] * self.size  # decoder calls each of the group ran for shared decodes, by rank
        self.lora_slots: dict[int, LoraRef] = {}  # what the members' slots hold, to resend
        self._call_scope = contextlib.ExitStack()  # CFG-parallel with LoRA: the worker's rows narrowed for a call
        self._dir = tempfile.mkdtemp(prefix="dvllm-group-")
        self._generation = 0
        threads = torch.get_num_threads()  # a CPU member runs as many torch threads as the worker
        self.members = [GroupMember(lambda: engine_config, place, threads, rank)
                        for rank, place in enumerate(devices, 1)]
        for member in self.members:  # a member's call (a forward, a decode share) is bounded as the collectives are
            member.bounds = CallBounds(config.timeout_s, config.start_timeout_s)
        try:
            self._load()
            self._form(first=True)
        except BaseException:
            self.close()
            raise
        self._hooks = [hook for denoiser in denoisers for hook in (
            denoiser.register_forward_pre_hook(self._share_call, with_kwargs=True),
            denoiser.register_forward_hook(self._call_done))]

    def load_lora(self, slot: int, ref: LoraRef | None) -> None:
        """The members' slot made the worker's (after the worker loaded it; None: emptied): each member reads the
        adapter itself. A group that fails under it is formed anew, which loads every slot again."""
        if ref is None:
            self.lora_slots.pop(slot, None)
        else:
            self.lora_slots[slot] = ref
        with self.lock:
            try:
                self._send_lora(slot)
            except Exception as e:  # noqa: BLE001 - as guard's
                if not self._recover("LoRA load", e):
                    self.lora_slots.pop(slot, None)
                    raise

    def choose_split(self, rows: int) -> None:
        """Before a step's forwards: with the elastic policy, the split its `rows` run best with."""
        if self.elastic:
            self.row_groups = self.size if rows_split_pays(rows, self.size) else 1

    def guard(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`fn` (a call that runs the denoiser) run again on a group formed anew when the group fails under it."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            with self.lock:
                try:
                    return self._run(fn, args, kwargs, self._runs_alone())
                except TooFewTokens:  # a sequence shorter than the group: every process stopped at its split
                    self._abandon_call()
                return self._run(fn, args, kwargs, True)  # (a pure function of its inputs: the same output)

        return run

    def _run(self, fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict, alone: bool) -> torch.Tensor:
        # the worker's split off: a forward alone, or (elastic) a rows step
        paused = self.splits_tokens and (alone or self.row_groups == self.size)
        with contextlib.ExitStack() as split_off:
            if paused:
                for denoiser in self.denoisers:
                    split_off.enter_context(context_parallel_paused(denoiser))
            self._alone = alone
            try:
                return fn(*args, **kwargs)
            except TooFewTokens:
                raise
            except Exception as e:  # noqa: BLE001 - the group is in an unknown state after any failed forward
                self._call_scope.close()  # (a call that failed inside never reached _call_done)
                if alone or not self._recover("forward", e):  # (alone, the members were not in it)
                    raise
            try:
                return fn(*args, **kwargs)
            finally:
                self._call_scope.close()

    def _runs_alone(self) -> bool:
        """Whether the forward about to run must run on the worker alone: one with step-cached rows, whose skip
        decisions read every row's whole tokens and whose state lives in the worker's pool."""
        return self.context is not None and self.context.cache is not None

    def _abandon_call(self) -> None:
        """The shared call that stopped at its split (TooFewTokens) let go: the members' answers to it taken (each
        stopped there too, or ran no rows of it), and it is not counted as split."""
        self._call_scope.close()
        self.forwards["rows" if self.row_groups > 1 else "tokens"] -= 1
        try:
            for member in self.members:
                member.done()
        except Exception as e:  # noqa: BLE001 - as guard's; the forward then runs alone anyway
            self._recover("forward", e)

    def decode_units(self, units: list[torch.Tensor], run: Callable[[torch.Tensor], torch.Tensor]
                     ) -> list[torch.Tensor]:
        """The VAE decoder's outputs for `units` (its inputs), shared out across the group by size (`run` decodes
        the leader's share); if the group fails under it, it is formed anew and the leader decodes them all."""
        shares = assign(units, self.size)
        with self.lock:
            try:
                busy = [m for m in self.members if shares[m.index]]
                for member in busy:
                    # (copies: a tile is a view of the whole latents, all of which a view pickles)
                    member.send(DecodeCalls([units[i].to("cpu", copy=True) for i in shares[member.index]]))
                outputs: list[Any] = [None] * len(units)
                for i in shares[0]:
                    outputs[i] = run(units[i])
                for member in busy:
                    for i, output in zip(shares[member.index], member.done(), strict=True):
                        outputs[i] = output.to(self.device)
                for rank, share in enumerate(shares):
                    self.units_decoded[rank] += len(share)
                return outputs
            except Exception as e:  # noqa: BLE001 - as guard's
                if not self._recover("decode", e):
                    raise
            self.units_decoded[0] += len(units)
            return [run(u) for u in units]

    def _recover(self, what: str, error: Exception) -> bool:
        """The group formed anew after a failed exchange; whether the group caused the failure (a member lost,
        a collective's or a channel's error), so that it is worth running again."""
        lost = [m.index for m in self.members if not m.alive]
        logger.error("a grouped %s failed (%s: %s; members lost: %s); forming the group anew", what,
                     type(error).__name__, error, lost or "none")
        self.reform()
        return bool(lost) or isinstance(error, (WorkerProcessLost, dist.DistError, EOFError, OSError))

    def reform(self) -> None:
        """Every member started again and the process group made again: what follows a lost member."""
        self.restarts += 1
        for member in self.members:
            member.start_again()
        if dist.is_initialized():  # (not after a reform that failed half-way)
            dist.destroy_process_group()
        self._load()
        self._form(first=False)
        for slot in self.lora_slots:
            self._send_lora(slot)

    def close(self) -> None:
        for member in self.members:
            member.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _load(self) -> None:
        for member in self.members:  # all load at once
            member.load()
        for member in self.members:
            member.loaded()

    def _form(self, first: bool) -> None:
        """The process group made with the members, then the denoiser split across it by each. Each generation
        meets at a file of its own, so nothing of a lost one is read."""
        self._generation += 1
        init_file = os.path.join(self._dir, f"rendezvous-{self._generation}")
        for member in self.members:
            member.send(JoinOrder(member.index, self.size, init_file, self.config.timeout_s))
        dist.init_process_group(backend(self.device), init_method=f"file://{init_file}", rank=0,
                                world_size=self.size, timeout=timedelta(seconds=self.config.timeout_s))
        for denoiser in self.denoisers if self.splits_tokens else ():  # in the members' order
            if first:
                span = self.size // self.cfg_groups
                enable_context_parallel(denoiser, span // self.ring, self.ring, self.device, self.cfg_groups)
            else:
                rejoin_context_parallel(denoiser)
        for member in self.members:
            member.done()

    def _send_lora(self, slot: int) -> None:
        for member in self.members:
            member.send(LoraSlot(slot, self.lora_slots.get(slot)))
        for member in self.members:
            member.done()

    def _call_loras(self) -> tuple | None:
        """The LoRA adapters of the call's rows, as (slot, weight) pairs: the forward's plan's rows, or those of
        the row scope the call runs in (an adapter's per-shape calls)."""
        context = self.context
        plan = None if context is None else context.lora
        if plan is None:
            return None
        rows = context.rows.rows
        return tuple(plan.sets) if rows is None else tuple(plan.sets[r] for r in rows)

    def _share_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Sends the call to every member; CFG-parallel: the worker keeps its own slice of the rows."""
        if self._alone:
            self.forwards["alone"] += 1
            return None
        tensors: list[torch.Tensor] = []
        skeleton = pack((args, kwargs), tensors)
        loras = self._call_loras()
        groups = self.row_groups
        expert = next(i for i, denoiser in enumerate(self.denoisers) if denoiser is module)
        for member in self.members:
            member.send(SharedCall(groups, skeleton, loras, expert))
        send_tensors(tensors)
        self.forwards["rows" if groups > 1 else "tokens"] += 1
        if groups == 1:
            return None
        rows = call_rows(args, kwargs)
        self._parts = [chunk(rows, group, groups) for group in range(groups)]
        mine = self._parts[0]
        if loras is not None and mine.stop - mine.start < rows:  # the worker's LoRA layers see its rows only
            self._call_scope.enter_context(self.context.narrow(
                list(range(mine.start, mine.stop)), torch.arange(mine.start, mine.stop, device=self.device)))
        return cut(args, kwargs, rows, mine)

    def _call_done(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """CFG-parallel: the members' rows after the worker's; then each member's end of the call."""
        self._call_scope.close()
        if self._alone:
            return output
        if self.row_groups > 1:
            output = gather_rows(output, self._parts, self.size // self.row_groups)
        for member in self.members:
            member.done()
        return output


def _check_member_devices(devices: list[str], device: torch.device) -> None:
    for place in devices:
        if torch.device(place).type != device.type:
            raise ValueError(f"group_devices {place!r}: a group's members run on the worker's device type "
                             f"({device.type})")
    check_devices([d for d in devices if torch.device(d).type == "cuda"], device, "group_devices",
                  "each member a GPU of its own")
    if len(set(devices)) != len(devices) and device.type == "cuda":
        raise ValueError(f"group_devices {devices}: each member needs a GPU of its own")
