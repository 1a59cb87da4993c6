"""The controlnet calls a request's rows take part in at a step (worker/controlnets.py groups equal calls of
several requests into one): by default one per control acting at that step; a family may make others (SDXL's union
calls, unet_controlnet.py). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dvllm.controls import Control


@dataclass(frozen=True)
class ControlCall:
    """One controlnet call a request's rows take part in at a step: rows of requests with equal calls (and kinds)
    share one."""

    place: int   # its first control's place in the request's list: calls add in this order
    name: str
    scale: float
    places: tuple[int, ...] = field(default=(), compare=False)  # the request's controls it runs, in order
    modes: tuple[int, ...] = ()     # an SDXL union call's control modes, one per control ...
    scales: tuple[float, ...] = ()  # ... and their scales, each times its window's keep (0 or 1) at this step


# (a request's controls, its step, its steps) -> the controlnet calls its rows take part in at that step
CallsOf = Callable[[tuple[Control, ...], int, int], list[ControlCall]]


def control_calls(controls: tuple[Control, ...], step: int, num_steps: int) -> list[ControlCall]:
    """One call per control acting at this step (a union Flux controlnet's mode goes per row)."""
    return [ControlCall(place, c.name, c.scale, (place,)) for place, c in enumerate(controls)
            if c.acts_at(step, num_steps)]
