"""An adapter's own request defaults, for adapters made to run other steps and guidance than their base model.

A step-distill LoRA (LightX2V's 4-step Wan LoRAs: 4 steps without classifier-free guidance) on a base served at 50
steps with CFG runs 25x the forwards it was made for, and with CFG at all it draws a worse video. So an adapter's
folder may hold `dvllm_defaults.json` (the name and format of a model folder's: param_defaults.py) with some of
ADAPTER_KEYS: a request that names the adapter and leaves such a field unset gets the adapter's value, before the
model's defaults fill the rest. Only a folder named as the adapter's path is read (a file path names its file
alone: a folder of several adapters has no single owner for one defaults file).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, TypeVar

from dvllm.param_defaults import DEFAULTS_FILE, read_defaults_file

# a request's SamplingParams (not imported: sampling_params imports this package, which sits above it)
Params = TypeVar("Params")

# what a request sets per se (a size or frame count belongs to the model, not to an adapter)
ADAPTER_KEYS = ("num_inference_steps", "guidance_scale", "sampler")


def read_adapter_defaults(path: str, weights_file: str) -> dict[str, Any]:
    """The defaults of the adapter that `path` (as the operator named it) located at `weights_file`: its folder's
    DEFAULTS_FILE when `path` named that folder ({} otherwise); ValueError naming the file for a bad one."""
    folder = os.path.dirname(weights_file)
    if os.path.isfile(os.path.expanduser(path)) or not os.path.isfile(os.path.join(folder, DEFAULTS_FILE)):
        return {}
    where = os.path.join(folder, DEFAULTS_FILE)
    defaults = read_defaults_file(where)
    other = sorted(set(defaults) - set(ADAPTER_KEYS))
    if other:
        raise ValueError(f"{where}: an adapter's defaults may set {', '.join(ADAPTER_KEYS)} only, not {other} "
                         "(sizes and frames are the model's)")
    return defaults


def with_adapter_defaults(params: Params, defaults_of: Callable[[str], dict[str, Any]]) -> Params:
    """`params` with the unset ADAPTER_KEYS filled from its adapters' defaults (`defaults_of(name)`); ValueError
    when two of its adapters set different values for a field the request leaves unset."""
    if not params.loras:
        return params
    chosen: dict[str, tuple[str, Any]] = {}
    for name in params.loras:
        for key, value in defaults_of(name).items():
            if getattr(params, key) is not None:
                continue
            if key in chosen and chosen[key][1] != value:
                first, given = chosen[key]
                raise ValueError(f"loras: adapters {first!r} and {name!r} default {key} to {given!r} and {value!r}; "
                                 f"set {key} in the request")
            chosen[key] = (name, value)
    return dataclasses.replace(params, **{key: value for key, (_, value) in chosen.items()}) if chosen else params
