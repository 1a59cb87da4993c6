"""Counting, on the CPU, what would make the host wait for a GPU stream.

On a CPU every tensor is a host tensor, so nothing waits; but the calls that wait on a GPU are visible:
- reads of a tensor's values on the host: `.item()`, `bool()`, `int()`, `.tolist()`, `.numpy()`, `.cpu()`,
  and ops whose output size depends on the data (`nonzero`, boolean-mask indexing, `masked_select`, ...);
- host data copied to the device with a blocking copy: `torch.tensor(..., device=...)`, a Python list used as
  an index (torch builds it on the host and copies it), `.to(device)` / `.cuda()` / `copy_` without
  `non_blocking=True` of a tensor built on the host: from Python data (`torch.tensor`, `from_numpy`, ...), by a
  factory called without a device (`torch.zeros(n)`, `torch.arange(n)`, `torch.randn(n)`, ...; the `*_like`
  ones follow their input), with a CPU generator, or computed from such tensors alone.
`HostSyncs` counts both kinds while active and remembers where each came from (the innermost dvllm or
diffusers frame), so a failing test names the line.
"""
from __future__ import annotations

import os
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops that read values on the host (their output's size or a Python scalar depends on the data)
# (torch.linalg's error check reads its info on the host: torch documents linalg.solve as syncing on CUDA)
DATA_READING_OPS = {aten._local_scalar_dense.default, aten._linalg_check_errors.default, aten.nonzero.default,
                    aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                    aten.repeat_interleave.Tensor}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
MAKERS = {torch.tensor, torch.as_tensor, torch.from_numpy}
# factories: made on the host unless given a device (the *_like ones follow their input: not here)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.linspace,
             torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
             torch.scalar_tensor, torch.tril_indices, torch.triu_indices}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


REPO = str(Path(__file__).resolve().parents[1]) + os.sep


def _where() -> str:
    """The innermost dvllm or diffusers line on the stack, relative to the repository or site-packages."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if ("/dvllm/" in frame.filename or "/diffusers/" in frame.filename) and "host_syncs" not in frame.filename:
            name = frame.filename.split("/site-packages/")[-1]
            return f"{name[len(REPO):] if name.startswith(REPO) else name}:{frame.lineno}"
    return "?"


class _Reads(TorchDispatchMode):
    def __init__(self, record, copies: "_Copies") -> None:
        super().__init__()
        self.record, self.copies = record, copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.copies.reading or (args and self.copies.is_host_made(args[0])):
            pass  # counted where it was called, or values already on the host: nothing waits
        elif func in DATA_READING_OPS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.record(f"{func}")
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.record(f"{func} with a boolean mask")
        return func(*args, **kwargs)


class _Copies(TorchFunctionMode):
    def __init__(self, record) -> None:
        super().__init__()
        self.record = record
        self._host: dict[int, weakref.ref] = {}  # by id: tensors compare by value, not identity
        # inside a read counted here (under inference_mode, the dispatch mode does not see `.item()`'s op)
        self.reading = False

    def is_host_made(self, t: Any) -> bool:
        ref = self._host.get(id(t)) if torch.is_tensor(t) else None
        return ref is not None and ref() is t

    def mark(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func in HOST_READS or (func is torch.Tensor.to and _to_cpu(args, kwargs))
        if args and (to_host or func is torch.Tensor.__getitem__) and self.is_host_made(args[0]):
            pass  # values already on the host
        elif to_host:
            self.record(f"{getattr(func, '__name__', func)}")
            self.reading = True
            try:
                return func(*args, **kwargs)
            finally:
                self.reading = False
        elif func in MAKERS and kwargs.get("device") is not None:
            self.record(f"{func.__name__}(..., device=...) (a blocking copy)")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_list(args[1]):
            self.record("a Python list as an index (a blocking copy)")
        elif func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_) and not kwargs.get("non_blocking"):
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            if torch.is_tensor(source) and self.is_host_made(source) and _to_device(func, args, kwargs):
                self.record(f"{func.__name__} of a host-built tensor without non_blocking")
        out = func(*args, **kwargs)
        if func in MOVES:  # on the CPU a move may return its input: from now on it stands for a device tensor
            self._host.pop(id(out), None)
        elif torch.is_tensor(out) and self._host_made(func, args, kwargs):
            self.mark(out)
        return out

    def _host_made(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Built on the host: from Python data, by a factory without a device, from a CPU generator, or computed
        from such tensors alone."""
        if func in MAKERS or func in FACTORIES:
            return kwargs.get("device") is None
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu":
            return True
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        return bool(tensors) and all(self.is_host_made(a) for a in tensors)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    # On the CPU the model's device is the host too: a move to the literal "cpu" is what reads to the host (the
    # engine names its device by a torch.device)
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return target == "cpu" and not kwargs.get("non_blocking")


def _to_device(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not torch.Tensor.to:
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device, torch.Tensor))


def _has_list(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


class HostSyncs:
    """`with HostSyncs() as syncs:` ...; `syncs.count`, `syncs.sites` (what -> where -> how often)."""

    def __init__(self, host: Iterable[torch.Tensor] = ()) -> None:
        """`host`: tensors made before the count began that live on the host on a GPU too (diffusers'
        schedulers keep their sigmas there), so that copies of them to the device count."""
        self.sites: Counter = Counter()
        self._host = list(host)

    def _record(self, what: str) -> None:
        self.sites[(what, _where())] += 1

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> "HostSyncs":
        copies = _Copies(self._record)
        for t in self._host:
            copies.mark(t)
        self._modes = [copies, _Reads(self._record, copies)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"  {n} x {what} at {where}" for (what, where), n in self.sites.most_common())
