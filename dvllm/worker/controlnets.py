"""ControlNet per request, inside one denoiser forward: loading, and each step's plan.

The controlnets the engine loaded at start (EngineConfig.controlnets) sit beside the denoiser. Each step the
rows whose requests have a control acting at that step (Control.acts_at) are grouped by the control's place in
its request's list, its controlnet, its scale and what the family says of the request's controlnets together
(its kind: SD's guess mode, how Flux maps a request's samples onto its blocks), or rather by the call the family
makes of them (calls_of, control_calls.py): on SDXL all of a request's controls on one ControlNetUnionModel are one
call, its images and modes together as StableDiffusionXLControlNetUnionPipeline passes them, which rows of requests
with the same modes and scales share; elsewhere each control is its own call (a union Flux controlnet's mode goes
per row). A group runs its controlnet on its rows alone, with the denoiser's own inputs of those rows, the
request's control inputs (made at its start, worker/start_latents.py), its scale; a family's forward pre-hook on
the denoiser (unet_controlnet.py, flux_controlnet.py) sums the groups' outputs per row, place by place, so a
request with several controls sums them in its own order, as diffusers' Multi-ControlNet models do. A row without
a control gets zeros, which leave its forward as it was (x + 0 is x); a forward with no control runs the denoiser
untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from dvllm.host_copy import device_index
from dvllm.models.base import ModelAdapter
from dvllm.models.layout import BatchLayout
from dvllm.models.quantization import QuantizationSpec, backend_config, quantize_loaded, quantizes_denoiser
from dvllm.worker.control_calls import CallsOf, control_calls
from dvllm.worker.control_plan import ControlGroup, ControlPlan
from dvllm.worker.control_state import control_image_shape, read_control_images
from dvllm.worker.flux_controlnet import FluxControlSamples, flux_request_kind
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.qwen_controlnet import QwenControlSamples, qwen_request_kind
from dvllm.worker.request_state import RequestState
from dvllm.worker.sd3_controlnet import SD3ControlSamples, sd3_request_kind
from dvllm.worker.state_pool import StatePool
from dvllm.worker.unet_controlnet import ControlResiduals, unet_request_calls, unet_request_kind
from dvllm.worker.z_image_controlnet import ZImageControlSamples, z_image_request_kind

# (a request's controlnets, in its order) -> (only its conditional rows run them, the kind its groups share)
KindOf = Callable[[list[Any]], tuple[bool, Hashable]]


def control_modes(controlnets: dict[str, Any]) -> dict[str, int]:
    """The union controlnets' control mode counts by name: a ControlNetUnionModel's num_control_type, a
    FluxControlNetModel's num_mode (None on others)."""
    counts = {name: getattr(net.config, "num_control_type", None) or getattr(net.config, "num_mode", None)
              for name, net in controlnets.items()}
    return {name: count for name, count in counts.items() if count}


def load_controlnets(paths: dict[str, str], adapter: ModelAdapter,
                     quantization: QuantizationSpec | None = None) -> dict[str, Any]:
    """{name: controlnet} from diffusers' folders or Hub ids, in the denoiser's dtype on its device, quantized as
    the denoiser is (`--quantization` without components, or naming it); ValueError naming the one that does not
    load, or the family that takes none."""
    if not paths:
        return {}
    if adapter.controlnet_class is None:
        raise ValueError(f"controlnets: the {adapter.info.family} family takes no ControlNet in dvllm yet "
                         "(SD 1.x/2.x, SDXL, SD3, Flux, Qwen-Image and Z-Image do)")
    quantized = quantizes_denoiser(quantization)
    options = {"quantization_config": backend_config(quantization)} if quantized else {}
    loaded = {}
    for name, path in paths.items():
        cls = _controlnet_class(adapter, name, path)
        try:
            loaded[name] = cls.from_pretrained(path, torch_dtype=adapter.dtype, **options).to(adapter.device).eval()
        except Exception as e:  # a missing folder, another model's weights: the operator's to fix
            raise ValueError(f"controlnets: {name}={path} does not load as a {cls.__name__}: {e}") from e
        if quantized:
            quantize_loaded(loaded[name], quantization, f"controlnet {name}")
    return loaded


def _controlnet_class(adapter: ModelAdapter, name: str, path: str) -> type:
    """The family's controlnet class, or its union one where the folder's config names that."""
    import diffusers

    cls, union = getattr(diffusers, adapter.controlnet_class), adapter.union_controlnet_class
    try:
        declared = cls.load_config(path).get("_class_name")
    except Exception:  # no config: the load names what is wrong
        return cls
    if declared == "ControlNetUnionModel" and union != declared:  # it would load as a plain one, its union parts
        raise ValueError(f"controlnets: {name}={path} is a ControlNetUnionModel, which the {adapter.info.family} "
                         "family does not take (SDXL does)")
    return getattr(diffusers, union) if union is not None and declared == union else cls


def control_planner(adapter: ModelAdapter, controlnets: dict[str, Any], hooks: ForwardHooks) -> ControlPlanner:
    """The planner of the family's controls, with the family's hook installed on its denoiser."""
    if adapter.controlnet_class == "FluxControlNetModel":
        FluxControlSamples(adapter.pipeline.transformer, hooks)
        return ControlPlanner(controlnets, flux_request_kind, row_modes=True)
    if adapter.controlnet_class == "SD3ControlNetModel":
        SD3ControlSamples(adapter.pipeline.transformer, hooks, controlnets.values())
        return ControlPlanner(controlnets, sd3_request_kind)
    if adapter.controlnet_class == "ZImageControlNetModel":
        ZImageControlSamples(adapter.pipeline.transformer, hooks, controlnets)
        return ControlPlanner(controlnets, z_image_request_kind)
    if adapter.controlnet_class == "QwenImageControlNetModel":
        QwenControlSamples(adapter.pipeline.transformer, hooks, controlnets)
        return ControlPlanner(controlnets, qwen_request_kind)
    ControlResiduals(adapter.pipeline.unet, hooks)
    return ControlPlanner(controlnets, unet_request_kind, unet_request_calls)


# What a request's control input is made of: its own tensor (made at its start: Flux's), or (its state, the blocks
# of its prepared image's shared entry in the state pool: SD's and SDXL's)
Source = torch.Tensor | tuple[RequestState, tuple[int, ...]]


@dataclass
class _Inputs:
    members: tuple[tuple[tuple[Source, ...], int], ...]  # (a request's call's inputs, its rows), in the group's order
    inputs: list[torch.Tensor]  # one per control of the call
    guidance: torch.Tensor
    row_modes: torch.Tensor | None


class ControlPlanner:
    """Makes each step's ControlPlan. A group's inputs are concatenated once while its members stay the same (the
    last step's are kept by group, held with the tensors they were made of, so identity compares them)."""

    def __init__(self, controlnets: dict[str, Any], kind_of: KindOf, calls_of: CallsOf = control_calls,
                 row_modes: bool = False) -> None:
        self.controlnets = controlnets
        self.kind_of = kind_of
        self.calls_of = calls_of
        self.row_modes = row_modes  # a union controlnet's mode goes per row (Flux's), not in the call
        self._last: dict[tuple, _Inputs] = {}

    def plan(self, states: list[RequestState], layout: BatchLayout, pool: StatePool) -> ControlPlan | None:
        """This step's groups (None: no row has a control acting now). `states` in the layout's request order."""
        members: dict[tuple, list[tuple[RequestState, tuple[int, ...], list[int]]]] = {}
        for request, state in enumerate(states):
            controls = state.data.controls
            if not controls:
                continue
            cond_only, kind = self.kind_of([self.controlnets[c.name] for c in controls])
            cond, uncond = layout.request_rows(request)
            rows = cond if cond_only else cond + uncond
            for call in self.calls_of(controls, state.step, state.plan.num_steps):
                members.setdefault((call, kind), []).append((state, call.places, rows))
        groups, kept = [], {}
        # place by place: each row sums in its request's order
        for key in sorted(members, key=lambda k: k[0].place):
            entries, (call, kind) = members[key], key
            made = kept[key] = self._inputs(key, entries, pool)
            rows = tuple(row for _, _, rows in entries for row in rows)
            groups.append(ControlGroup(self.controlnets[call.name], device_index(rows, pool.device), made.inputs[0],
                                       call.scale, kind, made.guidance, call, tuple(made.inputs[1:]), made.row_modes,
                                       rows))
        self._last = kept
        return ControlPlan(groups) if groups else None

    def _inputs(self, key: tuple, entries: list[tuple[RequestState, tuple[int, ...], list[int]]],
                pool: StatePool) -> _Inputs:
        members = tuple((tuple(_source(state, p) for p in places), len(rows)) for state, places, rows in entries)
        last = self._last.get(key)
        if last is not None and len(last.members) == len(members) and all(
                m == n and len(a) == len(b) and all(map(_same, a, b))
                for (a, m), (b, n) in zip(last.members, members)):
            return last
        net = self.controlnets[key[0].name]
        inputs = []
        for j in range(len(members[0][0])):  # (a call's members run the same controls: as many sources each)
            if isinstance(members[0][0][j], torch.Tensor):  # (a group is of one family: its sources of one kind)
                inputs.append(torch.cat([_per_row(sources[j], count) for sources, count in members]))
            else:  # one gather of every row's image from the pool
                rows = [sources[j][1] for sources, count in members for _ in range(count)]
                inputs.append(read_control_images(pool, rows, control_image_shape(entries[0][0]), net.dtype))
        guidance = torch.tensor([state.data.guidance_scale for state, _, rows in entries for _ in rows],
                                dtype=torch.float32).to(pool.device, non_blocking=True)
        return _Inputs(members, inputs, guidance, self._row_modes(entries, pool.device))

    def _row_modes(self, entries: list[tuple[RequestState, tuple[int, ...], list[int]]],
                   device: torch.device) -> torch.Tensor | None:
        """[rows] long: each row's control mode, where the family takes them per row and the controlnet has them
        (a group's controls are on one controlnet: all name a mode, or none does)."""
        if not self.row_modes or entries[0][0].data.controls[entries[0][1][0]].mode is None:
            return None
        modes = [state.data.controls[places[0]].mode for state, places, rows in entries for _ in rows]
        return torch.tensor(modes).to(device, non_blocking=True)


def _source(state: RequestState, place: int) -> Source:
    made = state.control_images[place] if state.control_images else None
    return made if made is not None else (state, tuple(state.blocks.controls[place]))


def _same(a: Source, b: Source) -> bool:
    """The same input: the same tensor, or the same request's image in the same blocks (a request that left and
    one that came may be given the same blocks: its state tells them apart)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a[0] is b[0] and a[1] == b[1]


def _per_row(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A request's control input for each of its `rows`: one input for all (SD's image), or one per image (Flux's
    latents, drawn per image), its conditional rows then its unconditional ones."""
    if len(tensor) == 1:
        return tensor.expand(rows, *tensor.shape[1:])
    return tensor[torch.arange(rows, device=tensor.device) % len(tensor)]
