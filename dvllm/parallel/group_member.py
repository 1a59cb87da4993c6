"""A worker group's member: a process of dvllm's runtime (runtime/spawn.py), started by the
group's leader (parallel/group.py). It joins the group's process group, loads the model as the leader did and keeps
its denoisers alone (a two-expert model's both: a call names its expert); then, for each denoiser call the leader
makes, it receives the call's arguments and runs it with the leader. Sequence parallel: the whole call, split
inside the forward by the same context-parallel plan (the output is the leader's; a member's is dropped).
CFG-parallel: its own slice of the rows, whose output it sends to the leader. It also decodes its share of the
leader's VAE decodes (parallel/group_decode.py).

LoRA: a member holds the same adapter slots as the leader (their denoiser layers only: the leader encodes), each
load sent to it as the leader loads (`LoraSlot`, the adapter's id: the member reads the file itself), and each call
names its rows' adapters by slot."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import types
from datetime import timedelta
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from dvllm.lora.cache import LoraCache, lora_cache_for
from dvllm.lora.ref import LoraRef
from dvllm.lora.weights import LoraWeights
from dvllm.models.base import denoiser_component, denoisers_of
from dvllm.models.load_config import LoadConfig
from dvllm.parallel.call_broadcast import receive
from dvllm.parallel.group_decode import DecodeCalls
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.parallel.row_split import call_rows, chunk, cut, send_rows
from dvllm.runtime.channel import Channel
from dvllm.worker.forward_context import ForwardContext, ForwardHooks
from dvllm.worker.lora_layers import LoraLayers, LoraPlan
from dvllm.worker.stage_process import serve

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JoinOrder:
    """Where the group meets (a file of the generation's own) and the member's rank in it."""

    rank: int
    world_size: int
    init_file: str
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class SharedCall:
    """A denoiser call the leader makes (its skeleton; the tensors follow by broadcast), how many row groups
    split its rows (runs of consecutive ranks that split their slice's tokens; 1: one group, every row's tokens
    split), and each of its rows' LoRA adapters as (slot, weight) pairs (None: no row has any)."""

    row_groups: int
    skeleton: Any
    lora_rows: tuple[tuple[tuple[int, float], ...], ...] | None = None
    expert: int = 0  # which denoiser: a two-expert model's (Wan 2.2 A14B) second is 1


@dataclasses.dataclass(frozen=True)
class LoraSlot:
    """An adapter, by id, whose denoiser layers the member reads into a slot of its own (None: the slot emptied)."""

    slot: int
    ref: LoraRef | None


def denoiser_lora(weights: LoraWeights, components: tuple[str, ...]) -> LoraWeights:
    """The adapter's layers in the denoiser `components` only (a two-expert model's both): what a member applies."""
    return dataclasses.replace(weights, layers={c: v for c, v in weights.layers.items() if c in components},
                               biases={c: v for c, v in weights.biases.items() if c in components})


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclasses.dataclass
class Member:
    """What a member holds: the denoisers (a two-expert model's both), the group's config, the VAE decoder when
    the group shares its decodes (parallel/group_decode.py), and the LoRA slots over its denoisers (named
    `components` in the pipeline) with the adapters it read, when LoRA is on."""

    denoisers: list[torch.nn.Module]
    parallel: ParallelConfig
    decoder: torch.nn.Module | None = None
    lora: LoraLayers | None = None
    lora_cache: LoraCache | None = None
    components: tuple[str, ...] = ("transformer",)

    def load_lora(self, slot: int, ref: LoraRef | None) -> None:
        """The adapter's denoiser layers, read from its file (or the member's cache), into the slot; None: emptied."""
        if self.lora is None or self.lora_cache is None:
            raise RuntimeError("this member holds no LoRA slots (enable_lora is off)")
        if ref is None:
            self.lora.evict(slot)
        else:
            self.lora.load(slot, denoiser_lora(self.lora_cache.weights(ref), self.components))

    def with_loras(self, rows: tuple | None) -> ContextManager[None]:
        """The call's rows' adapters, as a plan over the member's slots, given to its LoRA layers for the span."""
        if rows is None or self.lora is None or not self.lora.tables or not any(rows):
            return contextlib.nullcontext()
        return self.lora.hooks.running(ForwardContext(lora=LoraPlan(list(rows), self.lora)))


def load_denoiser(config: Any, device: torch.device) -> Member:
    """The model loaded as the leader loaded it (same weights, dummy ones from the same seed), the denoisers kept."""
    from dvllm.models.loader import load_adapter

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The text encoders load on the CPU (no member runs them) and go with the rest of the pipeline
    load = dataclasses.replace(LoadConfig.of(config), encoder_device="cpu")
    adapter = load_adapter(config.model, config.load_format, device, config.dtype, seed=config.dummy_weight_seed,
                           default_params=config.default_params, load=load)
    from dvllm.parallel.group_decode import decodes_in_group

    parallel = ParallelConfig.of(config)  # the member's part of the engine's settings, resolved once
    vae, denoisers = adapter.pipeline.vae, denoisers_of(adapter.pipeline)
    components = (denoiser_component(adapter.pipeline), "transformer_2")[:len(denoisers)]
    decoder = vae.decoder if decodes_in_group(parallel, vae) else None
    lora = None
    if config.enable_lora:  # slots over the denoisers alone, as many and as wide as the leader's
        lora = LoraLayers(types.SimpleNamespace(**dict(zip(components, denoisers))), config.max_loras,
                          config.max_lora_rank, ForwardHooks())
    del adapter, vae
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Member(denoisers, parallel, decoder, lora, lora_cache_for(config), components)


def join(member: Member, order: JoinOrder, device: torch.device) -> None:
    """Into the process group, then (sequence parallel) each denoiser split as the leader splits its own."""
    from dvllm.parallel.context_parallel import enable_context_parallel

    config = member.parallel
    dist.init_process_group(backend(device), init_method=f"file://{order.init_file}", rank=order.rank,
                            world_size=order.world_size, timeout=timedelta(seconds=order.timeout_s))
    if config.sequence_parallel_size > 1:
        for denoiser in member.denoisers:  # in the leader's order: each makes its mesh with collectives
            enable_context_parallel(denoiser, config.sequence_parallel_size // config.ring_degree,
                                    config.ring_degree, device, config.cfg_parallel_size)


def run(member: Member, message: Any, device: torch.device) -> list[torch.Tensor] | None:
    if isinstance(message, JoinOrder):
        join(member, message, device)
        return None
    if isinstance(message, DecodeCalls):  # the member's share of a decode: the decoder's outputs, to the leader
        if member.decoder is None:
            raise RuntimeError("this member holds no VAE decoder (the group does not share its decodes)")
        return [member.decoder(latents.to(device)).cpu() for latents in message.inputs]
    if isinstance(message, LoraSlot):
        member.load_lora(message.slot, message.ref)
        return None
    from dvllm.parallel.uneven_split import TooFewTokens

    try:
        return shared_call(member, message, device)
    except TooFewTokens:  # the leader runs this call alone (every process of the group stopped at the same split)
        return None
    except Exception:
        # A shared call that failed leaves its collectives half done: the member leaves, so that every peer
        # waiting on it (the leader for its rows, a token partner) fails now rather than at group_timeout_s, and
        # the leader forms the group anew.
        logger.exception("group member %d: a shared denoiser call failed; leaving the group", dist.get_rank())
        os._exit(1)


def shared_call(member: Member, message: SharedCall, device: torch.device) -> None:
    """The leader's denoiser call, run with it: whole (its tokens split inside), or this member's row group's rows
    (whose first rank sends the output to the leader)."""
    from dvllm.parallel.context_parallel import context_parallel_paused

    args, kwargs = receive(message.skeleton, device)
    denoiser = member.denoisers[message.expert]
    groups = message.row_groups
    if groups == 1:  # the same call: the split is inside the forward
        with member.with_loras(message.lora_rows):
            denoiser(*args, **kwargs)
        return None
    rows, rank, span = call_rows(args, kwargs), dist.get_rank(), dist.get_world_size() // groups
    part = chunk(rows, rank // span, groups)  # this member's row group's rows
    if part.stop > part.start:
        mine_args, mine_kwargs = cut(args, kwargs, rows, part)
        # (elastic) a rows step on a group that splits tokens: each rank's rows run whole
        paused = member.parallel.sequence_parallel_size > 1 and span == 1
        with context_parallel_paused(denoiser) if paused else contextlib.nullcontext(), \
                member.with_loras(None if message.lora_rows is None else message.lora_rows[part]):
            output = denoiser(*mine_args, **mine_kwargs)
        if rank % span == 0:  # the row group's first rank answers for it (its ranks end with the same output)
            send_rows(output)
    return None


def main(channel: Channel, device: str) -> None:
    """The process's target (dvllm.runtime.spawn)."""
    serve(channel, device, load_denoiser, run)
