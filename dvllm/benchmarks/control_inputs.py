"""ControlNet conditions for benchmark traces: which requests carry controls, their seeded images, and random
controlnets for the names a trace uses.

A trace with controls (`dvllm bench trace images --controls 0.4`) gives that share of its requests controls, as
in the SwiftDiffusion (Katz) production trace, where ControlNets ride along with LoRAs: three in four of them one
control, the rest two, each naming a controlnet of a small pool (control0, control1, ...; two on one request are
different ones) at its own scale, some acting only on the first part of the steps. A control's image is drawn from
a seed at the request's size: outlines of shapes on black, an edge map as a canny controlnet takes it. The controls
are drawn from a generator of their own, so a trace with controls is the same requests as the one without, plus
their controls.
"""
from __future__ import annotations

import functools
import io
import os
import random
from typing import Any

import numpy as np

_COUNTS = [(0.75, 1), (0.25, 2)]   # controls on a controlled request
_ENDS = [(0.7, 1.0), (0.3, 0.8)]   # control_guidance_end: most act on every step


def draw_controls(rng: random.Random, share: float, pool: int) -> list[dict[str, Any]] | None:
    """A request's controls (None for most, as `share` says): each {name, image_seed, scale, start, end}."""
    if not share or rng.random() >= share:
        return None
    count = min(pool, rng.choices([c for _, c in _COUNTS], weights=[s for s, _ in _COUNTS])[0])
    names = rng.sample(range(pool), count)
    return [{"name": f"control{k}", "image_seed": rng.randrange(2**31), "scale": round(rng.uniform(0.5, 1.0), 2),
             "start": 0.0, "end": rng.choices([e for _, e in _ENDS], weights=[s for s, _ in _ENDS])[0]}
            for k in names]


@functools.lru_cache(maxsize=256)
def _image_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        shape = rng.choice((draw.rectangle, draw.ellipse))
        x0, y0 = rng.randrange(max(1, width - 4)), rng.randrange(max(1, height - 4))
        x1, y1 = rng.randrange(x0 + 2, width + 2), rng.randrange(y0 + 2, height + 2)
        shape((x0, y0, x1, y1), outline=(255, 255, 255), width=max(1, min(width, height) // 64))
    return image.tobytes()


def control_image(width: int, height: int, seed: int) -> np.ndarray:
    """The control's image, HxWx3 uint8: the same arguments always give the same pixels."""
    return np.frombuffer(_image_bytes(width, height, seed), dtype=np.uint8).reshape(height, width, 3).copy()


def control_image_png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(control_image(width, height, seed)).save(out, format="PNG")
    return out.getvalue()


def random_controlnets(pipe: Any, names: list[str], root: str) -> dict[str, str]:
    """name -> folder of a ControlNetModel of the pipeline's UNet architecture, random weights (seed by name's
    place), saved as diffusers saves one: for presets with dummy weights, where only its cost matters."""
    import torch
    from diffusers import ControlNetModel

    unet = getattr(pipe, "unet", None)
    if unet is None:
        raise ValueError(f"{type(pipe).__name__} has no UNet: dvllm serves ControlNet on SD and SDXL")
    # the conditioning embedding brings the image down to the latents' size: one level per halving of the VAE
    levels = len(pipe.vae.config.block_out_channels)
    folders = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)
        net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 96, 256)[:levels],
                                        load_weights_from_unet=False)
        folders[name] = os.path.join(root, name)
        net.to(unet.dtype).save_pretrained(folders[name])
    return folders
