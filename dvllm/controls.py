"""A request's ControlNet conditions: which loaded controlnet, its image, its scale and its window of steps.

`SamplingParams.controls` takes a list of them (dicts or `Control`s); each names a controlnet the engine loaded
at start (`EngineConfig.controlnets`, `--controlnet NAME=PATH`). As diffusers' ControlNet pipelines take them:
`scale` is `controlnet_conditioning_scale`, `start` and `end` are `control_guidance_start` / `_end`, fractions
of the request's steps, and several controls on one request add their residuals in the order given (diffusers'
MultiControlNetModel). A union controlnet (SDXL's ControlNetUnionModel, a FluxControlNetModel with num_mode) takes a
`mode` with each control, its control_mode; another takes none. Torch-free: the driver checks requests before
anything heavy loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_CONTROLS = 4         # controls on one request (each runs a controlnet on its rows every step in its window)
MAX_CONTROL_SCALE = 100.0
_FIELDS = ("name", "image", "scale", "start", "end", "mode")


@dataclass(frozen=True)
class Control:
    name: str            # a controlnet the engine loaded (EngineConfig.controlnets)
    image: Any           # its conditioning image: a PIL image, an HxWx3 uint8 array or a file path
    scale: float = 1.0   # its residuals' weight
    start: float = 0.0   # the fraction of the steps where it begins to act
    end: float = 1.0     # ... and where it stops
    mode: int | None = None  # a union controlnet's control mode (checked against its count at resolve time)

    def acts_at(self, step: int, num_steps: int) -> bool:
        """Whether it acts on step `step` of `num_steps`: diffusers' controlnet_keep, 1 unless the step starts
        before `start` or ends after `end`."""
        return not (step / num_steps < self.start or (step + 1) / num_steps > self.end)


def parse_controls(value: Any) -> tuple[Control, ...] | None:
    """The request's controls checked (not their names or images, which need the engine and the model);
    ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"controls must be a list of {{name, image, scale, start, end, mode}}, got "
                         f"{type(value).__name__}")
    if len(value) > MAX_CONTROLS:
        raise ValueError(f"controls: at most {MAX_CONTROLS} controls on one request, got {len(value)}")
    return tuple(_control(item, f"controls[{i}]") for i, item in enumerate(value)) or None


def _control(item: Any, where: str) -> Control:
    if isinstance(item, Control):
        fields = {name: getattr(item, name) for name in _FIELDS}
    elif isinstance(item, dict):
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; a control has {list(_FIELDS)}")
        fields = dict(item)
    else:
        raise ValueError(f"{where} must be an object {{name, image, scale, start, end, mode}}, got "
                         f"{type(item).__name__}")
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must name a controlnet the engine loaded, got {name!r}")
    if fields.get("image") is None:
        raise ValueError(f"{where}.image: a control needs its conditioning image")
    scale = _number(f"{where}.scale", fields.get("scale", 1.0))
    if not 0.0 <= scale <= MAX_CONTROL_SCALE:
        raise ValueError(f"{where}.scale must be in [0, {MAX_CONTROL_SCALE:g}], got {scale!r}")
    start, end = _number(f"{where}.start", fields.get("start", 0.0)), _number(f"{where}.end", fields.get("end", 1.0))
    if not 0.0 <= start < end <= 1.0:
        raise ValueError(f"{where}: start and end are fractions of the steps with 0 <= start < end <= 1, "
                         f"got start={start!r}, end={end!r}")
    mode = fields.get("mode")
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or mode < 0):
        raise ValueError(f"{where}.mode must be a union controlnet's control mode, an integer >= 0, got {mode!r}")
    return Control(name, fields["image"], scale, start, end, mode)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
