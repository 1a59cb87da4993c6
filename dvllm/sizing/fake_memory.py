"""Peak activation memory of a model's real code, run on fake tensors: no weights, no GPU.

The models are built on the meta device and moved to FakeTensorMode's fake CPU tensors; a forward then
runs every op for its shapes only. PeakTracker (worker/peak_tracker.py), a dispatch mode, adds each op's new output storages'
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
from collections import Counter
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dvllm.worker.memory_profile import DeviceMemory
from dvllm.worker.peak_tracker import PeakTracker

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

