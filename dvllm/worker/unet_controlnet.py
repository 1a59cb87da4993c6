"""SD's and SDXL's ControlNetModels on the UNet: a forward pre-hook that adds the forward's controls' down and
mid residuals to its call, as StableDiffusion[XL]ControlNetPipeline hands them to the UNet.

In guess mode (a controlnet with global_pool_conditions, decided by the request's first control, as diffusers
decides it) only the conditional rows run the controlnet; the unconditional ones get zeros, as there.
"""
from __future__ import annotations

from typing import Any

import torch

from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks


def unet_request_kind(controlnets: list[Any]) -> tuple[bool, bool]:
    """(only the conditional rows run them, guess mode): both from the request's first controlnet."""
    guess = bool(getattr(controlnets[0].config, "global_pool_conditions", False))
    return guess, guess


class ControlResiduals:
    """The UNet's forward pre-hook (ForwardHooks gives it the forward's context; a context without a ControlPlan
    passes the call through)."""

    def __init__(self, unet: torch.nn.Module, hooks: ForwardHooks) -> None:
        self.context: ForwardContext | None = None
        hooks.add(DENOISER, self)
        unet.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        plan = None if self.context is None else self.context.control
        if plan is None:
            return None
        sample = args[0] if args else kwargs["sample"]
        timestep = args[1] if len(args) > 1 else kwargs["timestep"]
        text, added = kwargs["encoder_hidden_states"], kwargs.get("added_cond_kwargs")
        down: list[torch.Tensor] | None = None
        mid: torch.Tensor | None = None
        for group in plan.groups:
            index = group.index
            group_down, group_mid = group.controlnet(
                # the latents alone: an inpainting UNet's mask and masked-image channels are its own, as in
                # diffusers' ControlNet inpainting pipelines
                sample[index, :group.controlnet.config.in_channels], timestep[index] if timestep.dim() else timestep, encoder_hidden_states=text[index],
                controlnet_cond=group.inputs, conditioning_scale=group.scale, guess_mode=group.kind,
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
