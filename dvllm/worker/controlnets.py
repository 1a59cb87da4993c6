"""ControlNet per request, inside one denoiser forward.

The controlnets the engine loaded at start (EngineConfig.controlnets) sit beside the UNet. Each step the rows
whose requests have a control acting at that step (Control.acts_at) are grouped by the control's place in its
request's list, its controlnet and its scale. A group runs its controlnet on its rows alone, as diffusers'
ControlNet pipelines call it: the UNet's own inputs of those rows (latents, timestep, text, SDXL's added
conditions), the request's prepared image, its scale. Its residuals are added to those rows' sums, place by
place, so a request with several controls sums them in its own order, as MultiControlNetModel does. The UNet
then gets the sums as its additional residuals; a row without a control gets zeros, which leave its forward as
it was (x + 0 is x). A forward pre-hook on the UNet does this, given each forward's ControlPlan through its
context: a forward with no control runs the UNet untouched.

In guess mode (a controlnet with global_pool_conditions, decided by the request's first control, as diffusers
decides it) only the conditional rows run the controlnet; the unconditional ones get zeros, as there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dvllm.host_copy import device_index
from dvllm.models.base import ModelAdapter
from dvllm.models.layout import BatchLayout
from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks
from dvllm.worker.request_state import RequestState


def load_controlnets(paths: dict[str, str], adapter: ModelAdapter) -> dict[str, Any]:
    """{name: controlnet} from diffusers' folders or Hub ids, in the denoiser's dtype on its device;
    ValueError naming the one that does not load, or the family that takes none."""
    if not paths:
        return {}
    if adapter.controlnet_class is None:
        raise ValueError(f"controlnets: the {adapter.info.family} family takes no ControlNet in dvllm yet "
                         "(SD 1.x/2.x and SDXL do)")
    import diffusers

    cls = getattr(diffusers, adapter.controlnet_class)
    loaded = {}
    for name, path in paths.items():
        try:
            loaded[name] = cls.from_pretrained(path, torch_dtype=adapter.dtype).to(adapter.device).eval()
        except Exception as e:  # a missing folder, another model's weights: the operator's to fix
            raise ValueError(f"controlnets: {name}={path} does not load as a {cls.__name__}: {e}") from e
    return loaded


@dataclass
class ControlGroup:
    """Rows of one forward that run one controlnet at one scale, for the same place in their lists."""

    controlnet: Any
    index: torch.Tensor   # the rows, on the device
    images: torch.Tensor  # [rows, 3, H, W] their requests' prepared images
    scale: float
    guess: bool


@dataclass
class ControlPlan:
    groups: list[ControlGroup]  # in the order their residuals are added


def control_plan(states: list[RequestState], layout: BatchLayout, controlnets: dict[str, Any],
                 device: torch.device) -> ControlPlan | None:
    """This step's groups (None: no row has a control acting now). `states` in the layout's request order."""
    members: dict[tuple[int, str, float], list[tuple[int, torch.Tensor]]] = {}
    guess_of: dict[tuple[int, str, float], bool] = {}
    for request, state in enumerate(states):
        controls = state.data.controls
        if not controls:
            continue
        images = _device_images(state, controlnets, device)
        guess = bool(controlnets[controls[0].name].config.global_pool_conditions)
        cond, uncond = layout.request_rows(request)
        rows = cond if guess else cond + uncond
        for place, (control, image) in enumerate(zip(controls, images)):
            if not control.acts_at(state.step, state.plan.num_steps):
                continue
            key = (place, control.name, control.scale)
            members.setdefault(key, []).extend((row, image) for row in rows)
            guess_of[key] = guess_of.get(key, guess)
    if not members:
        return None
    groups = []
    for key in sorted(members, key=lambda k: k[0]):  # place by place: each row sums in its request's order
        rows = members[key]
        groups.append(ControlGroup(controlnets[key[1]], device_index([r for r, _ in rows], device),
                                   torch.cat([image for _, image in rows]), key[2], guess_of[key]))
    return ControlPlan(groups)


def _device_images(state: RequestState, controlnets: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    """The request's prepared control images on the device, in its controlnets' dtype (copied once)."""
    if state.control_images is None:
        state.control_images = [control.image.to(device=device, dtype=controlnets[control.name].dtype,
                                                 non_blocking=True) for control in state.data.controls]
    return state.control_images


class ControlResiduals:
    """The UNet's forward pre-hook: adds the forward's controls' residuals to its call (ForwardHooks gives it the
    forward's context; a context without a ControlPlan passes the call through)."""

    def __init__(self, unet: torch.nn.Module, hooks: ForwardHooks) -> None:
        self.context: ForwardContext | None = None
        hooks.add(DENOISER, self)
        self.handle = unet.register_forward_pre_hook(self, with_kwargs=True)  # (the memory profile removes its own)

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
                sample[index], timestep[index] if timestep.dim() else timestep, encoder_hidden_states=text[index],
                controlnet_cond=group.images, conditioning_scale=group.scale, guess_mode=group.guess,
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
