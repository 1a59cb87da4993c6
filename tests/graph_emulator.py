"""A CUDA graph's semantics on the CPU, for tests: record a forward's ops once, replay them later.

A CUDA graph replays the kernels its capture recorded, on the same memory: what changes between replays
is only what was written into that memory (the static inputs, the tables a layer reads). Python does not
run again, so anything the forward decided on the host, or built from host values during the capture,
is frozen. This stand-in does the same with a TorchDispatchMode: `capture` records every aten op with its
argument and result tensors; `replay` calls each op again on those same tensor objects and copies each
fresh result into the recorded one, so later ops read it. A forward whose replay with new inputs gives
what eager gives is one a CUDA graph replays right.

An op a capture cannot hold (reading a value back: .item(), nonzero, a boolean mask) fails the capture,
as it would on a GPU.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

UNCAPTURABLE = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
                "aten._unique2", "aten.equal", "aten.is_nonzero"}


class UncapturableOp(RuntimeError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in UNCAPTURABLE:
            raise UncapturableOp(f"{func} reads a value back to the host: a CUDA graph cannot capture it")
        if name == "aten.index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
            raise UncapturableOp("indexing with a boolean mask has a data-dependent shape")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, [t for t in tree_flatten(out)[0] if torch.is_tensor(t)]))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class EmulatedGraph:
    def __init__(self, ops: list[tuple[Any, tuple, dict, list]]) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if torch.is_tensor(t)]
            for old, new in zip(recorded, fresh):
                if new is not old and _storage(new) != _storage(old):  # not an in-place result or a view
                    old.copy_(new)
        self.replays += 1


def emulated_capture(run: Callable[[], torch.Tensor], pool: Any = None) -> tuple[EmulatedGraph, torch.Tensor]:
    """Denoiser's `capture` on the CPU: a warm-up run, then one recorded run."""
    run()
    recorder = _Recorder()
    with recorder:
        output = run()
    return EmulatedGraph(recorder.ops), output
