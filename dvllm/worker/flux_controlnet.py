"""Flux's FluxControlNetModels on the FluxTransformer2DModel: a forward pre-hook that hands the forward's controls'
block samples to the transformer, as FluxControlNetPipeline does (controlnet_block_samples,
controlnet_single_block_samples).

The transformer adds sample j to the output of its block i, j picked from the number of samples: i // interval
(interval = ceil(blocks / samples)), or i % samples with controlnet_blocks_repeat (XLabs' controlnets, with an
input_hint_block). One forward has one such choice, so the hook gives the transformer one sample per block
(interval 1, no repeat), each the sum of what each group maps onto that block for its rows: a block whose groups
pick the same samples shares one tensor. How a request's samples map is decided as diffusers decides it for the
request's controlnets together (FluxMultiControlNetModel): repeat from its first controlnet, and the number of
samples the first's, or fewer where its later controlnets have fewer (their lists are summed with zip); a first
controlnet without double (or single) blocks leaves that list out. A row without a control gets zeros. A union
controlnet (num_mode) takes each row's control mode (the planner's row_modes): rows of different modes share a call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dvllm.worker.control_hook import ControlHook
from dvllm.worker.forward_context import ForwardHooks


@dataclass(frozen=True)
class FluxSamples:
    """How a request's summed samples map onto the transformer's blocks."""

    repeat: bool  # controlnet_blocks_repeat (its first controlnet has an input_hint_block)
    double: int   # samples for the double-stream blocks (0: none)
    single: int   # for the single-stream blocks

    def pick(self, block: int, blocks: int, single: bool) -> int | None:
        """The sample the transformer adds after block `block` of `blocks` (None: none)."""
        count = self.single if single else self.double
        if not count:
            return None
        if self.repeat and not single:
            return block % count
        return block // math.ceil(blocks / count)


def flux_request_kind(controlnets: list[Any]) -> tuple[bool, FluxSamples]:
    """(only conditional rows: Flux has no others, so no), how its samples map (the module's docstring)."""
    first = controlnets[0]
    return False, FluxSamples(first.input_hint_block is not None,
                              _summed([net.config.num_layers for net in controlnets]),
                              _summed([net.config.num_single_layers for net in controlnets]))


def _summed(counts: list[int]) -> int:
    """The length of the samples lists summed as FluxMultiControlNetModel sums them: the first's (0: none, and
    it stays none), cut to the shortest of the later ones that have any."""
    return 0 if not counts[0] else min(c for c in counts if c)


class FluxControlSamples(ControlHook):
    """The transformer's forward pre-hook (ForwardHooks gives it the forward's context; a context without a
    ControlPlan passes the call through)."""

    def __init__(self, transformer: torch.nn.Module, hooks: ForwardHooks) -> None:
        super().__init__(transformer, hooks)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, timestep = kwargs["hidden_states"], kwargs["timestep"]
        pooled, text = kwargs["pooled_projections"], kwargs["encoder_hidden_states"]
        outputs = []
        for group in plan.groups:
            index, net = group.index, group.controlnet
            outputs.append(net(
                hidden_states=hidden[index], controlnet_cond=group.inputs, conditioning_scale=group.scale,
                timestep=timestep[index] if timestep.dim() else timestep,
                guidance=group.guidance if net.config.guidance_embeds else None,  # as the pipeline: the net's own
                pooled_projections=pooled[index], encoder_hidden_states=text[index],
                txt_ids=kwargs["txt_ids"], img_ids=kwargs["img_ids"], return_dict=False,
                # a union controlnet's mode per row, [rows, 1], as FluxControlNetPipeline's control_mode
                **({} if group.row_modes is None else {"controlnet_mode": group.row_modes[:, None]})))
        double = _per_block(plan.groups, [out[0] for out in outputs], len(module.transformer_blocks), len(hidden),
                            single=False)
        single = _per_block(plan.groups, [out[1] for out in outputs], len(module.single_transformer_blocks),
                            len(hidden), single=True)
        kwargs = dict(kwargs, controlnet_block_samples=double, controlnet_single_block_samples=single,
                      controlnet_blocks_repeat=False)
        return args, kwargs


def _per_block(groups: list, samples: list[list[torch.Tensor] | None], blocks: int, rows: int,
               single: bool) -> list[torch.Tensor] | None:
    """One tensor per block ([rows, tokens, width]): each group's pick for that block on its rows, summed in the
    groups' order into zeros (None: no group adds anything to these blocks)."""
    picks = [tuple(None if outs is None else group.kind.pick(block, blocks, single)
                   for group, outs in zip(groups, samples)) for block in range(blocks)]
    if all(p is None for pick in picks for p in pick):
        return None
    shape, like = next((outs[0].shape[1:], outs[0]) for outs in samples if outs is not None)
    sums: dict[tuple, torch.Tensor] = {}
    for pick in picks:
        if pick in sums:
            continue
        total = like.new_zeros((rows, *shape))
        for group, outs, j in zip(groups, samples, pick):
            if j is not None:
                total.index_add_(0, group.index, outs[j])
        sums[pick] = total
    return [sums[pick] for pick in picks]
