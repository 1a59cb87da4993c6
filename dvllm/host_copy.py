"""Host values onto the device without making the host wait.

A tensor built from Python data lives in pageable host memory; copying it to a GPU with a plain `.to()`
blocks until the stream has drained. Pinned memory and `non_blocking=True` queue the copy instead (torch's
caching host allocator keeps the pinned buffer alive until the copy has run), so the host can go on
building the next step while the GPU runs this one.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued behind the stream's work rather than waiting for it."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)  # (on its own device already: t itself)


def device_tensor(data: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(data) built on the host and copied without a wait."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def device_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row numbers as a long index on `device`."""
    return device_tensor(list(rows), device, torch.long)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A host tensor copied into `dst` (e.g. a CUDA graph's static input) without a wait; returns dst."""
    if src.device != dst.device and dst.device.type == "cuda":
        src = src.pin_memory()
    return dst.copy_(src, non_blocking=True)
