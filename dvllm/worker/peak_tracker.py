"""PeakTracker: the peak bytes of the storages ops make inside it, on real tensors or on FakeTensorMode's fake
ones. It adds each op's new output storages' bytes as they are made and takes them off when their storages are
freed, keeping the peak: what a caching allocator would have to hold, before its rounding and fragmentation and
without the kernels' own workspaces (cuBLAS, cuDNN), which no op returns. The worker measures a decode with it on
the CPU (decode_tiling.py); dvllm/sizing/fake_memory.py runs whole models on fake tensors under it.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd
# New tensors this small (masks, position ids, timesteps) are made real inside a fake run, as tokenizers'
# outputs are: code that reads their values (a truncation check, a mask's lengths) then runs as it would.
SMALL_NUMEL = 1 << 16


def attention_kind(op_name: str) -> str | None:
    """Which attention an op is: a fused SDPA kernel, or the math path (its _safe_softmax); None: neither."""
    if "_scaled_dot_product_" in op_name and "backward" not in op_name:
        return op_name.removeprefix("aten.").split(".")[0].lstrip("_")
    if op_name.startswith("aten._safe_softmax"):
        return "math (materialized scores)"
    return None



class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages ops create inside it, and their peak. Works on real tensors as well as
    fake ones (`fake_mode`: the FakeTensorMode under it, whose small host-side tensors it makes real)."""

    def __init__(self, fake_mode: FakeTensorMode | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.now = self.peak = 0
        self.attention: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "aten" and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT):
            with self:  # a composite op's parts pass through here too: the kernels inside it are seen
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        kind = attention_kind(str(func))
        if kind:
            self.attention[kind] += 1
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out = self._run(func, args, kwargs, tensors)
        # views and in-place results add nothing; lift_fresh brings in a tensor made outside any op (a tokenizer's)
        inputs = {t.untyped_storage()._cdata for t in tensors} if func is not aten.lift_fresh.default else set()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), inputs)
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if self.fake_mode is None:
            return func(*args, **kwargs)
        real = not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)
        if tensors and real:  # host-side work (token ids, masks: no weight reaches them): real, values and all
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is aten.index.Tensor and not real:  # x[mask] with a real mask: its true positions, as indices
            args = (args[0], [_real_indices(i) for i in args[1]])
            args = (args[0], [part for i in args[1] for part in (i if isinstance(i, tuple) else (i,))])
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not tensors and outs and all(t.numel() <= SMALL_NUMEL for t in outs):
            with unset_fake_temporarily():  # a small new tensor (torch.ones(n), arange): real too
                return func(*args, **kwargs)
        return out

    def _add(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key = storage._cdata
        if key in inputs or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)  # the storage's Python object lives as long as it does

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def _real_indices(index: Any) -> Any:
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool and not isinstance(index, FakeTensor):
        with unset_fake_temporarily():
            return index.nonzero(as_tuple=True)
    return index
