"""A worker group's member: `python -m dvllm.parallel.group_member <pipe fd> <device> <threads>`, started by the
group's leader (parallel/group.py). It joins the group's process group, loads the model as the leader did and keeps
its denoiser alone; then, for each denoiser call the leader makes, it receives the call's arguments and runs it
with the leader. Sequence parallel: the whole call, split inside the forward by the same context-parallel plan
(the output is the leader's; a member's is dropped). CFG-parallel: its own slice of the rows, whose output it
sends to the leader. It also decodes its share of the leader's VAE decodes (parallel/group_decode.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dvllm.parallel.call_broadcast import receive
from dvllm.parallel.group_decode import DecodeCalls
from dvllm.parallel.row_split import call_rows, chunk, cut, send_rows
from dvllm.worker.stage_process import serve


@dataclasses.dataclass(frozen=True)
class JoinOrder:
    """Where the group meets (a file of the generation's own) and the member's rank in it."""

    rank: int
    world_size: int
    init_file: str
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class SharedCall:
    """A denoiser call the leader makes (its skeleton; the tensors follow by broadcast), and how it is split:
    by rows, or (False) by every row's tokens."""

    split_rows: bool
    skeleton: Any


def denoiser_of(pipeline: Any) -> torch.nn.Module:
    """The pipeline's denoiser: its transformer, or its UNet."""
    return getattr(pipeline, "transformer", None) or pipeline.unet


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclasses.dataclass
class Member:
    """What a member holds: the denoiser, the engine's config, and the VAE decoder when the group shares its
    decodes (parallel/group_decode.py)."""

    denoiser: torch.nn.Module
    config: Any  # EngineConfig
    decoder: torch.nn.Module | None = None


def load_denoiser(config: Any, device: torch.device) -> Member:
    """The model loaded as the leader loaded it (same weights, dummy ones from the same seed), the denoiser kept."""
    from dvllm.models.loader import load_adapter

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The text encoders load on the CPU (no member runs them) and go with the rest of the pipeline
    load = dataclasses.replace(config.load_config, encoder_device="cpu")
    adapter = load_adapter(config.model, config.load_format, device, config.dtype, seed=config.dummy_weight_seed,
                           default_params=config.default_params, load=load)
    from dvllm.parallel.group_decode import decodes_in_group

    denoiser, vae = denoiser_of(adapter.pipeline), adapter.pipeline.vae
    decoder = vae.decoder if decodes_in_group(config, vae) else None
    del adapter, vae
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Member(denoiser, config, decoder)


def join(member: Member, order: JoinOrder, device: torch.device) -> None:
    """Into the process group, then (sequence parallel) the denoiser split as the leader splits its own."""
    from dvllm.parallel.context_parallel import enable_context_parallel

    config = member.config
    dist.init_process_group(backend(device), init_method=f"file://{order.init_file}", rank=order.rank,
                            world_size=order.world_size, timeout=timedelta(seconds=order.timeout_s))
    if config.sequence_parallel_size > 1:
        enable_context_parallel(member.denoiser, config.sequence_parallel_size // config.ring_degree,
                                config.ring_degree, device)


def run(member: Member, message: Any, device: torch.device) -> list[torch.Tensor] | None:
    if isinstance(message, JoinOrder):
        join(member, message, device)
        return None
    if isinstance(message, DecodeCalls):  # the member's share of a decode: the decoder's outputs, to the leader
        if member.decoder is None:
            raise RuntimeError("this member holds no VAE decoder (the group does not share its decodes)")
        return [member.decoder(latents.to(device)).cpu() for latents in message.inputs]
    from dvllm.parallel.context_parallel import context_parallel_paused

    args, kwargs = receive(message.skeleton, device)
    denoiser = member.denoiser
    if not message.split_rows:  # the same call: the split is inside the forward
        denoiser(*args, **kwargs)
        return None
    rows = call_rows(args, kwargs)
    part = chunk(rows, dist.get_rank(), dist.get_world_size())
    if part.stop > part.start:
        mine_args, mine_kwargs = cut(args, kwargs, rows, part)
        # (elastic) a rows step on a group that splits tokens: this member's rows run whole
        paused = member.config.sequence_parallel_size > 1
        with context_parallel_paused(denoiser) if paused else contextlib.nullcontext():
            send_rows(denoiser(*mine_args, **mine_kwargs))
    return None


if __name__ == "__main__":  # this module's own names, which is what the leader pickles (not __main__'s)
    from dvllm.parallel import group_member

    serve(group_member.load_denoiser, group_member.run)
