"""Reads a generated image with plain image arithmetic: which colour, which shape.

The shape is the largest connected set of pixels clearly off the white background; its colour
is the named colour nearest to their median; its class comes from how much of its bounding box it fills
(square ~1.0, circle ~0.75, triangle ~0.5, five-pointed star ~0.4).
"""
from __future__ import annotations

import numpy as np

from dvllm.tiny_shapes.data import COLORS

FILL = {"square": 1.0, "circle": 0.75, "triangle": 0.52, "star": 0.39}


def read_image(image: np.ndarray) -> tuple[str | None, str | None]:
    """(colour, shape) of an HxWx3 image in [0, 1] or uint8; (None, None) if nothing stands out."""
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.max() <= 1.0:
        pixels = pixels * 255
    mask = np.abs(pixels - 255).sum(axis=-1) > 90
    if mask.sum() < 12:
        return None, None
    blob = _largest_blob(mask)
    # the shape's own pixels, not a tinted background or specks; the median ignores its blended rim
    typical = np.median(pixels[blob], axis=0)
    colour = min(COLORS, key=lambda name: float(np.square(np.array(COLORS[name]) - typical).sum()))
    ys, xs = np.nonzero(blob)
    fill = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    shape = min(FILL, key=lambda name: abs(FILL[name] - fill))
    return colour, shape


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region: stray specks must not stretch the bounding box."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y, x in zip(*np.nonzero(mask)):
        if labels[y, x]:
            continue
        current += 1
        stack, size = [(y, x)], 0
        labels[y, x] = current
        while stack:
            cy, cx = stack.pop()
            size += 1
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return labels == best
