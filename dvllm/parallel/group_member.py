"""A worker group's member: `python -m dvllm.parallel.group_member <pipe fd> <device> <threads>`, started by the
group's leader (parallel/group.py). It joins the group's process group, loads the model as the leader did and keeps
its denoiser alone, with the same context-parallel split; then, for each denoiser call the leader makes, it
receives the call's arguments and runs it with the leader, the collectives inside the forward exchanging what
each needs. The output is the leader's: a member's is dropped."""
from __future__ import annotations

import dataclasses
import gc
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dvllm.parallel.call_broadcast import receive
from dvllm.worker.stage_process import serve


@dataclasses.dataclass(frozen=True)
class JoinOrder:
    """Where the group meets (a file of the generation's own) and the member's rank in it."""

    rank: int
    world_size: int
    init_file: str
    timeout_s: float


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def load_denoiser(config: Any, device: torch.device) -> torch.nn.Module:
    """The model loaded as the leader loaded it (same weights, dummy ones from the same seed), the denoiser kept."""
    from dvllm.models.loader import load_adapter

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The text encoders load on the CPU (no member runs them) and go with the rest of the pipeline
    load = dataclasses.replace(config.load_config, encoder_device="cpu")
    adapter = load_adapter(config.model, config.load_format, device, config.dtype, seed=config.dummy_weight_seed,
                           default_params=config.default_params, load=load)
    denoiser = adapter.pipeline.transformer
    denoiser.group_config = config
    del adapter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return denoiser


def join(denoiser: torch.nn.Module, order: JoinOrder, device: torch.device) -> None:
    """Into the process group, then the denoiser split as the leader splits its own."""
    from dvllm.parallel.context_parallel import enable_context_parallel

    config = denoiser.group_config
    dist.init_process_group(backend(device), init_method=f"file://{order.init_file}", rank=order.rank,
                            world_size=order.world_size, timeout=timedelta(seconds=order.timeout_s))
    enable_context_parallel(denoiser, config.sequence_parallel_size // config.ring_degree, config.ring_degree,
                            device)


def run(denoiser: torch.nn.Module, message: Any, device: torch.device) -> None:
    if isinstance(message, JoinOrder):
        join(denoiser, message, device)
        return
    args, kwargs = receive(message, device)
    denoiser(*args, **kwargs)


if __name__ == "__main__":  # this module's own names, which is what the leader pickles (not __main__'s)
    from dvllm.parallel import group_member

    serve(group_member.load_denoiser, group_member.run)
