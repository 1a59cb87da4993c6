"""One module call sent from a group's leader to its members: the arguments' structure (and every value that is
not a tensor) goes as a small picklable skeleton over each member's channel (dvllm.runtime), the tensors by
torch.distributed broadcasts from rank 0 on the group's device (NCCL between GPUs, gloo on the CPU), in the order
the skeleton lists them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was in the arguments: the members make one of this shape and dtype and receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def pack(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by its TensorSlot; the tensors appended to `tensors`, in order."""
    if torch.is_tensor(value):
        tensors.append(value.contiguous())
        return TensorSlot(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(pack(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: pack(v, tensors) for k, v in value.items()}
    return value


def send_tensors(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


def receive(skeleton: Any, device: torch.device) -> Any:
    """The leader's arguments rebuilt on `device`: each slot's tensor received, in the order pack made them."""
    if isinstance(skeleton, TensorSlot):
        tensor = torch.empty(skeleton.shape, dtype=skeleton.dtype, device=device)
        dist.broadcast(tensor, src=0)
        return tensor
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(receive(v, device) for v in skeleton)
    if isinstance(skeleton, dict):
        return {k: receive(v, device) for k, v in skeleton.items()}
    return skeleton
