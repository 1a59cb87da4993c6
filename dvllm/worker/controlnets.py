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
from dvllm.models.quantization import QuantizationSpec, backend_config, quantize_loaded, quantizes_denoiser
from dvllm.worker.control_state import control_image_shape, read_control_images
from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks
from dvllm.worker.request_state import RequestState
from dvllm.worker.state_pool import StatePool


def load_controlnets(paths: dict[str, str], adapter: ModelAdapter,
                     quantization: QuantizationSpec | None = None) -> dict[str, Any]:
    """{name: controlnet} from diffusers' folders or Hub ids, in the denoiser's dtype on its device, quantized as
    the denoiser is (`--quantization` without components, or naming it); ValueError naming the one that does not
    load, or the family that takes none."""
    if not paths:
        return {}
    if adapter.controlnet_class is None:
        raise ValueError(f"controlnets: the {adapter.info.family} family takes no ControlNet in dvllm yet "
                         "(SD 1.x/2.x and SDXL do)")
    import diffusers

    cls = getattr(diffusers, adapter.controlnet_class)
    quantized = quantizes_denoiser(quantization)
    options = {"quantization_config": backend_config(quantization)} if quantized else {}
    loaded = {}
    for name, path in paths.items():
        try:
            net = cls.from_pretrained(path, torch_dtype=adapter.dtype, **options)
        except Exception as e:  # a missing folder, another model's weights: the operator's to fix
            raise ValueError(f"controlnets: {name}={path} does not load as a {cls.__name__}: {e}") from e
        loaded[name] = net = net.to(adapter.device).eval()
        if quantized:
            quantize_loaded(net, quantization, f"controlnet {name}")
    return loaded


@dataclass
class ControlGroup:
    """Rows of one forward that run one controlnet at one scale, for the same place in their lists."""

    controlnet: Any
    index: torch.Tensor   # the rows, on the device
    images: torch.Tensor  # [rows, 3, H, W] their requests' prepared images (read from the pool)
    scale: float
    guess: bool


@dataclass
class ControlPlan:
    groups: list[ControlGroup]  # in the order their residuals are added


def control_plan(states: list[RequestState], layout: BatchLayout, controlnets: dict[str, Any],
                 pool: StatePool) -> ControlPlan | None:
    """This step's groups (None: no row has a control acting now). `states` in the layout's request order, of one
    size (a forward's requests share it)."""
    members: dict[tuple[int, str, float], list[tuple[int, tuple[int, ...]]]] = {}
    guess_of: dict[tuple[int, str, float], bool] = {}
    shape = None
    for request, state in enumerate(states):
        controls = state.data.controls
        if not controls:
            continue
        shape = control_image_shape(state)
        guess = bool(controlnets[controls[0].name].config.global_pool_conditions)
        cond, uncond = layout.request_rows(request)
        rows = cond if guess else cond + uncond
        for place, (control, blocks) in enumerate(zip(controls, state.blocks.controls)):
            if not control.acts_at(state.step, state.plan.num_steps):
                continue
            key = (place, control.name, control.scale)
            members.setdefault(key, []).extend((row, blocks) for row in rows)
            guess_of[key] = guess_of.get(key, guess)
    if not members:
        return None
    groups = []
    for key in sorted(members, key=lambda k: k[0]):  # place by place: each row sums in its request's order
        rows, controlnet = members[key], controlnets[key[1]]
        images = read_control_images(pool, [b for _, b in rows], shape, controlnet.dtype)
        groups.append(ControlGroup(controlnet, device_index([r for r, _ in rows], pool.device), images, key[2],
                                   guess_of[key]))
    return ControlPlan(groups)


class ControlResiduals:
    """The UNet's forward pre-hook: adds the forward's controls' residuals to its call (ForwardHooks gives it the
    forward's context; a context without a ControlPlan passes the call through)."""

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
