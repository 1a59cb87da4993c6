"""Qwen-Image's QwenImageControlNetModels on the QwenImageTransformer2DModel: a forward pre-hook that hands the
forward's controls' block samples to the transformer, as QwenImageControlNetPipeline does
(controlnet_block_samples).

The pipeline runs the controlnet once a step, with the prompt's text, and hands the same samples to the
transformer's pass on the negative prompt (true CFG): so a group runs its controlnet on its requests' conditional
rows only, and each unconditional row takes its conditional row's sums (row num_cond + i is row i's copy). The
transformer adds sample i // ceil(blocks / samples) after its block i; one forward has one list, so the hook gives
it one sample per block, each the sum of what each group maps onto that block for its rows (a request's controls
all name one controlnet, so its samples are that controlnet's; QwenImageMultiControlNetModel sums several images
of it sample by sample). A row without a control gets zeros.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dvllm.worker.control_hook import ControlHook
from dvllm.worker.forward_context import ForwardHooks


def qwen_request_kind(controlnets: list[Any]) -> tuple[bool, int]:
    """(only conditional rows run them: the pipeline's negative pass reuses their samples, the number of samples
    of its controlnet: a request names one)."""
    return True, controlnets[0].config.num_layers


class QwenControlSamples(ControlHook):
    """The transformer's forward pre-hook (ForwardHooks gives it the forward's context; a context without a
    ControlPlan passes the call through)."""

    def __init__(self, transformer: torch.nn.Module, hooks: ForwardHooks, controlnets: dict[str, Any]) -> None:
        for name, net in controlnets.items():  # QwenImageControlNetInpaintPipeline's: a mask beside the image
            if net.config.extra_condition_channels:
                raise ValueError(f"controlnets: {name} is an inpainting controlnet (extra_condition_channels); "
                                 "Qwen-Image's ControlNet inpainting is not served yet")
        super().__init__(transformer, hooks)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, timestep, text = kwargs["hidden_states"], kwargs["timestep"], kwargs["encoder_hidden_states"]
        mask = kwargs.get("encoder_hidden_states_mask")
        samples = []
        for group in plan.groups:
            index = group.index
            samples.append(group.controlnet(
                hidden_states=hidden[index], controlnet_cond=group.inputs, conditioning_scale=group.scale,
                encoder_hidden_states=text[index], encoder_hidden_states_mask=None if mask is None else mask[index],
                timestep=timestep[index], img_shapes=kwargs["img_shapes"], return_dict=False))
        layout = self.context.layout
        blocks = _per_block(plan.groups, samples, len(module.transformer_blocks), len(hidden),
                            (layout.num_cond, layout.num_cfg))
        return args, dict(kwargs, controlnet_block_samples=blocks)


def _per_block(groups: list, samples: list[list[torch.Tensor]], blocks: int, rows: int,
               halves: tuple[int, int]) -> list[torch.Tensor]:
    """One tensor per block ([rows, tokens, width]): each group's sample for that block on its rows, summed in
    the groups' order into zeros, then copied to the unconditional rows (`halves`: the conditional rows, the
    unconditional ones after them)."""
    num_cond, num_cfg = halves
    picks = [tuple(block // math.ceil(blocks / group.kind) for group in groups) for block in range(blocks)]
    like = samples[0][0]
    sums: dict[tuple, torch.Tensor] = {}
    for pick in picks:
        if pick in sums:
            continue
        total = like.new_zeros((rows, *like.shape[1:]))
        for group, outs, j in zip(groups, samples, pick):
            total.index_add_(0, group.index, outs[j])
        total[num_cond:num_cond + num_cfg] = total[:num_cfg]
        sums[pick] = total
    return [sums[pick] for pick in picks]
