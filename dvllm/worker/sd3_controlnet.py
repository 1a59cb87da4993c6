"""SD3's SD3ControlNetModels on the SD3Transformer2DModel: a forward pre-hook that hands the forward's controls' block
samples to the transformer, as StableDiffusion3ControlNetPipeline does (block_controlnet_hidden_states).

The transformer adds sample int(i / (blocks / samples)) after its block i (not after a block with context_pre_only,
its last). One forward gives one list, so the hook gives it one sample per block (the interval is then 1), each the
sum of what each group maps onto that block for its rows. A request's samples count as SD3MultiControlNetModel
sums them (zip over its controlnets: the fewest); a row without a control gets zeros. As in the pipeline, every row
runs the controlnet (CFG's unconditional ones too, with their own text), with zeros for the pooled projections
where the request's first controlnet forces them (InstantX's; the pipeline reads the first one's config for all
of them) and no text for the controlnets without a context embedder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from dvllm.worker.control_hook import ControlHook
from dvllm.worker.forward_context import ForwardHooks


@dataclass(frozen=True)
class SD3Samples:
    """What a request's controlnets need together."""

    count: int          # the samples their outputs sum to (SD3MultiControlNetModel's zip: the fewest)
    zero_pooled: bool   # its first controlnet's force_zeros_for_pooled_projection, which the pipeline applies to all


def sd3_request_kind(controlnets: list[Any]) -> tuple[bool, SD3Samples]:
    """(only conditional rows: no), what its controlnets need together."""
    return False, SD3Samples(min(len(net.transformer_blocks) for net in controlnets),
                             bool(controlnets[0].config.force_zeros_for_pooled_projection))


class SD3ControlSamples(ControlHook):
    """The transformer's forward pre-hook (ForwardHooks gives it the forward's context; a context without a
    ControlPlan passes the call through)."""

    def __init__(self, transformer: torch.nn.Module, hooks: ForwardHooks, controlnets: Iterable[Any]) -> None:
        for net in controlnets:  # SD3.5's large controlnets share the transformer's position embedding, as there
            if getattr(net.config, "use_pos_embed", True) is False:
                net.pos_embed = net._get_pos_embed_from_transformer(transformer).to(net.device, net.dtype)
        super().__init__(transformer, hooks)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, timestep = kwargs["hidden_states"], kwargs["timestep"]
        pooled, text = kwargs["pooled_projections"], kwargs["encoder_hidden_states"]
        outputs = []
        for group in plan.groups:
            index, net = group.index, group.controlnet
            rows_pooled = pooled[index]
            outputs.append(net(
                hidden_states=hidden[index], controlnet_cond=group.inputs, conditioning_scale=group.scale,
                timestep=timestep[index] if timestep.dim() else timestep,
                pooled_projections=torch.zeros_like(rows_pooled) if group.kind.zero_pooled else rows_pooled,
                encoder_hidden_states=text[index] if net.context_embedder is not None else None,
                return_dict=False)[0])
        blocks = len(module.transformer_blocks)
        # each group's sample for each block, as the pipeline picks it (in its float arithmetic); blocks whose
        # groups pick the same samples share one sum
        picks = [tuple(int(block / (blocks / group.kind.count)) for group in plan.groups) for block in range(blocks)]
        sums: dict[tuple[int, ...], torch.Tensor] = {}
        for pick in picks:
            if pick not in sums:
                first = outputs[0][pick[0]]
                total = sums[pick] = first.new_zeros((len(hidden), *first.shape[1:]))
                for group, samples, j in zip(plan.groups, outputs, pick):
                    total.index_add_(0, group.index, samples[j])
        return args, dict(kwargs, block_controlnet_hidden_states=[sums[pick] for pick in picks])
