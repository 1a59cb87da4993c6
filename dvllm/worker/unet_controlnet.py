"""SD's and SDXL's ControlNetModels on the UNet: a forward pre-hook that adds the forward's controls' down and
mid residuals to its call, as StableDiffusion[XL]ControlNetPipeline hands them to the UNet.

In guess mode (a controlnet with global_pool_conditions, decided by the request's first control, as diffusers
decides it) only the conditional rows run the controlnet; the unconditional ones get zeros, as there.

SDXL's ControlNetUnionModel takes all of a request's controls on it in one call, as
StableDiffusionXLControlNetUnionPipeline passes its lists: the images, the modes (one-hot per row and their
indices) and a scale each, its window's keep applied. With one control the model scales its residuals (0 outside
the window: the call is left out, as it adds zeros); with several it scales each control's features inside and
the call runs every step, outside the windows too, as there.
"""
from __future__ import annotations

from typing import Any

import torch

from dvllm.controls import Control
from dvllm.worker.control_calls import ControlCall
from dvllm.worker.control_hook import ControlHook
from dvllm.worker.forward_context import ForwardHooks


def unet_request_kind(controlnets: list[Any]) -> tuple[bool, bool]:
    """(only the conditional rows run them, guess mode): both from the request's first controlnet."""
    guess = bool(getattr(controlnets[0].config, "global_pool_conditions", False))
    return guess, guess


def unet_request_calls(controls: tuple[Control, ...], step: int, num_steps: int) -> list[ControlCall]:
    """A ControlNetModel's control is a call while it acts; a union controlnet's controls (those with a mode) are
    one call at its first one's place."""
    calls = []
    for place, c in enumerate(controls):
        if c.mode is None:  # a ControlNetModel's
            if c.acts_at(step, num_steps):
                calls.append(ControlCall(place, c.name, c.scale, (place,)))
            continue
        places = tuple(p for p, d in enumerate(controls) if d.name == c.name)
        if places[0] != place:  # a union call's later control: in its first one's call
            continue
        union = [controls[p] for p in places]
        keeps = [float(d.acts_at(step, num_steps)) for d in union]
        if len(union) == 1 and not keeps[0]:  # one control: its residuals, scaled by 0, would add nothing
            continue
        calls.append(ControlCall(place, c.name, c.scale, places, tuple(d.mode for d in union),
                                 tuple(d.scale * keep for d, keep in zip(union, keeps))))
    return calls


class ControlResiduals(ControlHook):
    """The UNet's forward pre-hook (ForwardHooks gives it the forward's context; a context without a ControlPlan
    passes the call through)."""

    def __init__(self, unet: torch.nn.Module, hooks: ForwardHooks) -> None:
        super().__init__(unet, hooks)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        sample = args[0] if args else kwargs["sample"]
        timestep = args[1] if len(args) > 1 else kwargs["timestep"]
        text, added = kwargs["encoder_hidden_states"], kwargs.get("added_cond_kwargs")
        down: list[torch.Tensor] | None = None
        mid: torch.Tensor | None = None
        for group in plan.groups:
            index, net = group.index, group.controlnet
            union = {} if group.call is None or not group.call.modes else _union_inputs(group, text.dtype)
            group_down, group_mid = net(
                # the latents alone: an inpainting UNet's mask and masked-image channels are its own, as in
                # diffusers' ControlNet inpainting pipelines
                sample[index, :net.config.in_channels], timestep[index] if timestep.dim() else timestep,
                encoder_hidden_states=text[index], guess_mode=group.kind,
                **(union or {"controlnet_cond": group.inputs, "conditioning_scale": group.scale}),
                added_cond_kwargs=None if added is None else {k: v[index] for k, v in added.items()},
                return_dict=False)
            if down is None:
                down = [torch.zeros((len(sample), *d.shape[1:]), dtype=d.dtype, device=d.device) for d in group_down]
                mid = torch.zeros((len(sample), *group_mid.shape[1:]), dtype=group_mid.dtype, device=group_mid.device)
            for total, part in zip(down, group_down):
                total.index_add_(0, index, part)
            mid.index_add_(0, index, group_mid)
        kwargs = dict(kwargs, down_block_additional_residuals=tuple(down), mid_block_additional_residual=mid)
        return args, kwargs


def _union_inputs(group: Any, dtype: torch.dtype) -> dict[str, Any]:
    """A ControlNetUnionModel's inputs of its call: the images, the modes one-hot per row (the pipeline's
    control_type, in the text embeddings' dtype) and as indices, a scale each."""
    modes = group.call.modes
    control_type = torch.zeros((len(group.inputs), group.controlnet.config.num_control_type), dtype=dtype,
                               device=group.inputs.device)
    control_type[:, list(modes)] = 1
    return {"controlnet_cond": [group.inputs, *group.more], "control_type": control_type,
            "control_type_idx": list(modes), "conditioning_scale": list(group.call.scales)}
