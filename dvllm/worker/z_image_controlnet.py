"""Z-Image's ZImageControlNetModels on the ZImageTransformer2DModel: a forward pre-hook that hands the forward's
controls' layer samples to the transformer, as ZImageControlNetPipeline does (controlnet_block_samples).

A ZImageControlNetModel shares the transformer's embedders, refiners and RoPE (from_transformer, done here once),
and with them their LoRA layers: it runs with the forward's context narrowed to its group's rows, so each row's
adapters apply there as in the transformer.
The pipeline runs it on its CFG batch, each row with its own text (the negative prompt's rows too) and the same
control input. It returns a sample per transformer layer it names (control_layers_places), [rows, tokens, dim]
over each row's single stream (image tokens then caption tokens, each padded to a multiple of 32), padded to its
rows' longest; the transformer adds sample j after its layer j to the stream padded to the forward's longest. The
hook sums each group's samples per layer into zeros of the forward's length (a row's own tokens come first, so a
group's shorter padding lines up); a row without a control gets zeros.
"""
from __future__ import annotations

from typing import Any

import torch

from dvllm.worker.control_hook import ControlHook
from dvllm.worker.forward_context import ForwardHooks

SEQ_MULTIPLE = 32  # the transformer pads the image and the caption tokens to multiples of this (SEQ_MULTI_OF)


def z_image_request_kind(controlnets: list[Any]) -> tuple[bool, None]:
    """(every row runs them, the unconditional ones with their own text, as the pipeline's CFG batch; nothing of
    the request's controlnets together)."""
    return False, None


class ZImageControlSamples(ControlHook):
    """The transformer's forward pre-hook (ForwardHooks gives it the forward's context; a context without a
    ControlPlan passes the call through)."""

    def __init__(self, transformer: torch.nn.Module, hooks: ForwardHooks, controlnets: dict[str, Any]) -> None:
        for net in controlnets.values():  # its shared modules are the transformer's own
            type(net).from_transformer(net, transformer)
        super().__init__(transformer, hooks)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        frames, timestep, captions = args[:3]  # (lists of rows, as ZImageAdapter.denoise calls it)
        samples = []
        for group in plan.groups:
            with self.context.narrow(list(group.rows), group.index):  # the shared modules' LoRA layers: its rows'
                samples.append(group.controlnet(
                    [frames[r] for r in group.rows], timestep[group.index], [captions[r] for r in group.rows],
                    list(group.inputs.unbind(0)), conditioning_scale=group.scale))
        image_tokens = _padded(frames[0].shape[-3] * (frames[0].shape[-2] // 2) * (frames[0].shape[-1] // 2))
        length = image_tokens + max(_padded(len(c)) for c in captions)
        return args, dict(kwargs, controlnet_block_samples=_per_layer(plan.groups, samples, len(frames), length))


def _padded(tokens: int) -> int:
    return tokens + (-tokens) % SEQ_MULTIPLE


def _per_layer(groups: list, samples: list[dict[int, torch.Tensor]], rows: int,
               length: int) -> dict[int, torch.Tensor]:
    """{layer: [rows, length, dim]}: each group's sample for that layer on its rows, summed in the groups' order
    into zeros (only the layers some group names)."""
    sums: dict[int, torch.Tensor] = {}
    for group, outs in zip(groups, samples):
        for layer, sample in outs.items():
            if layer not in sums:
                sums[layer] = sample.new_zeros((rows, length, sample.shape[-1]))
            sums[layer][:, :sample.shape[1]].index_add_(0, group.index, sample)
    return sums
