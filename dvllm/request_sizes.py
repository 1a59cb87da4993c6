"""The sizes a request's shape is made of: its latents' size key and its input images' sizes (no torch, no
models: the scheduler, the models' capability specs and the request checks all read these)."""
from __future__ import annotations

import math
from typing import Any


def size_of(height: int, width: int, num_frames: int | None) -> tuple[int, ...]:
    """What fixes a request's latents' shape, and what its decode takes: (height, width), and a video's frames
    after them. Requests share a forward only if theirs are equal."""
    return (height, width) if num_frames is None else (height, width, num_frames)


def as_images(image: Any) -> tuple[Any, ...]:
    """A resolved request's images as a tuple (it holds one PIL image, or a tuple for several; None: none)."""
    return () if image is None else image if isinstance(image, tuple) else (image,)


def image_sizes(image: Any) -> tuple[tuple[int, int], ...]:
    """(width, height) of each of a resolved request's images."""
    return tuple((i.width, i.height) for i in as_images(image))


def aspect_size(area: int, multiple: int, sizes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(height, width) of about `area` pixels at the one image's aspect ratio (`sizes`: its (width, height)),
    each a multiple of `multiple`: what Wan image-to-video makes of a request that names no size."""
    (width, height), = sizes
    ratio = height / width
    return (max(multiple, round(math.sqrt(area * ratio)) // multiple * multiple),
            max(multiple, round(math.sqrt(area / ratio)) // multiple * multiple))
