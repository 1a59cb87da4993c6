"""Peak activation memory of a model's real code, run on fake tensors: no weights, no GPU.

The models are built on the meta device and moved to FakeTensorMode's fake CPU tensors; a forward then
runs every op for its shapes only. PeakTracker, a dispatch mode, adds each op's new output storages'
bytes as they are made and takes them off when their storages are freed, keeping the peak: what a
caching allocator would have to hold, before its rounding and fragmentation and without the kernels'
own workspaces (cuBLAS, cuDNN), which no op returns. Fake CPU tensors take torch SDPA's fused CPU kernel
(output and logsumexp), the footprint of the flash and memory-efficient kernels a GPU picks (fake CUDA
tensors would take the math path, which holds every [rows, heads, L, L] score); where that kernel cannot
run a case (T5's float position bias) the CPU takes the math path. The tracker counts the attention kernels
each run took, so the estimate says which it was.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dvllm.worker.memory_profile import DeviceMemory

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


class TrackedMemory(DeviceMemory):
    """DeviceMemory for memory_profile.step_peaks that tracks instead of asking a device: each run's peak (on fake
    tensors under `fake_mode`, or on real ones without it) and the attention kernels each kind of work took
    (step_peaks runs encode, denoise, decode, in that order)."""

    PHASES = ("encode", "denoise", "decode")

    def __init__(self, fake_mode: FakeTensorMode | None) -> None:
        self.fake_mode = fake_mode
        self.runs = 0
        self.attention: dict[str, Counter[str]] = {phase: Counter() for phase in self.PHASES}

    def measure(self, run: Callable[[], None]) -> int:
        tracker = PeakTracker(self.fake_mode)
        with tracker:
            run()
        self.attention[self.PHASES[self.runs % len(self.PHASES)]].update(tracker.attention)
        self.runs += 1
        return tracker.peak

    def free_and_total(self) -> tuple[int, int]:
        raise NotImplementedError("a fake model has no device: memory_estimate does the pool's arithmetic")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers' and diffusers' warnings off (a fake run's tokenizers truncate, meta modules are cast)."""
    import diffusers
    import transformers

    before = transformers.logging.get_verbosity(), diffusers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    diffusers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(before[0])
        diffusers.logging.set_verbosity(before[1])


def fake_session() -> FakeTensorMode:
    """FakeTensorMode that takes real inputs too (tokenizers make real ids)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def to_fake(module: torch.nn.Module) -> None:
    """A meta-device module's parameters, buffers and plain tensor attributes (a rotary table kept out of the
    buffers) as fake CPU tensors of the same shapes and dtypes. Call inside fake_session."""
    module.to_empty(device="cpu")
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(sub, name, torch.empty_like(value, device="cpu"))


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each shared tensor once), at their dtypes."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())

