"""IP-Adapter (image prompts): where the engine's adapter is read from, and a request's image prompt checked.

The engine loads one IP-Adapter at start (EngineConfig.ip_adapter, `--ip-adapter WEIGHTS`) through diffusers'
`load_ip_adapter`, with its CLIP image encoder (EngineConfig.ip_adapter_image_encoder). A request gives an image
prompt (`SamplingParams.ip_adapter_image`) and its weight (`ip_adapter_scale`, what diffusers'
`set_ip_adapter_scale` sets for the whole pipeline, here per request). Torch-free: the driver checks requests
before anything heavy loads.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

MAX_IP_ADAPTER_SCALE = 10.0


@dataclass(frozen=True)
class Location:
    """A file or folder as diffusers' loaders take it: a local folder or Hub repo id, a subfolder in it, a name."""

    root: str
    subfolder: str = ""
    name: str | None = None


def weights_location(spec: str) -> Location:
    """`spec`: a local weights file (.safetensors or .bin), or a Hub file as REPO_OWNER/REPO/[SUBFOLDER/]FILE
    (h94/IP-Adapter/models/ip-adapter_sd15.bin)."""
    if os.path.isfile(spec):
        return Location(os.path.dirname(os.path.abspath(spec)), "", os.path.basename(spec))
    parts = spec.strip("/").split("/")
    if os.path.exists(spec) or len(parts) < 3 or not parts[-1].endswith((".safetensors", ".bin")):
        raise ValueError(f"ip_adapter: expected a weights file (.safetensors or .bin), local or on the Hub as "
                         f"OWNER/REPO/[SUBFOLDER/]FILE, got {spec!r}")
    return Location("/".join(parts[:2]), "/".join(parts[2:-1]), parts[-1])


def folder_location(spec: str) -> Location:
    """`spec`: a local folder, or a Hub folder as OWNER/REPO[/SUBFOLDER] (h94/IP-Adapter/models/image_encoder)."""
    if os.path.isdir(spec):
        return Location(spec)
    parts = spec.strip("/").split("/")
    if os.path.exists(spec) or len(parts) < 2:
        raise ValueError(f"ip_adapter_image_encoder: expected a folder, local or on the Hub as "
                         f"OWNER/REPO[/SUBFOLDER], got {spec!r}")
    return Location("/".join(parts[:2]), "/".join(parts[2:]))


def check_ip_adapter_config(weights: Any, image_encoder: Any) -> None:
    """The two settings' shapes (what they name is read at start)."""
    for name, value in (("ip_adapter", weights), ("ip_adapter_image_encoder", image_encoder)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a path or Hub name, got {value!r}")
    if image_encoder is not None and weights is None:
        raise ValueError("ip_adapter_image_encoder is set but no ip_adapter: it is the adapter's image encoder")


def check_ip_adapter_scale(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= MAX_IP_ADAPTER_SCALE:
        raise ValueError(f"ip_adapter_scale must be a number in [0, {MAX_IP_ADAPTER_SCALE:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ImagePrompt:
    """A request's image prompt as the worker gets it: the image (RGB, its pixels bounded at admission) and its
    weight."""

    image: Any
    scale: float = 1.0
