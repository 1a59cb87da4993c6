"""Reads a tiny-shapes image back with plain image arithmetic: colour, shape, size, position, and
whether the background is clean. The meaning tests and the caching table judge the models with it.

The shape is the largest 4-connected set of pixels clearly off the white background. Its colour is
the named colour nearest to their median (the median ignores the blended rim); its class comes from
how much of its bounding box it fills (square ~1.0, circle ~0.75, triangle ~0.5, five-pointed star
~0.4); its size from the longer side of that box; its position from its centroid. The background is
clean when no other blob stands out: off-white pixels more than a few pixels from the shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dvllm.tiny_shapes.data import COLORS, IMAGE_SIZE, POSITIONS

FILL = {"square": 1.0, "circle": 0.75, "triangle": 0.52, "star": 0.39}
OFF_WHITE = 90  # summed RGB distance from white that counts as "drawn"
MIN_PIXELS = 12  # fewer drawn pixels than this: nothing stands out
STRAY_PIXELS = 12  # more drawn pixels than this away from the shape: the background is not clean
RIM = 2  # pixels around the shape that may carry its blended edge
# A small shape's longer side spans at most ~23 px of a 64 px image, a large one's at least ~35 px.
SIZE_BOUNDARY = 29 / 64


@dataclass(frozen=True)
class Reading:
    colour: str | None
    shape: str | None
    size: str | None
    position: str | None
    clean: bool


def read_scene(image: np.ndarray) -> Reading:
    """What an HxWx3 image (floats in [0, 1] or uint8) shows."""
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.max() <= 1.0:
        pixels = pixels * 255
    drawn = np.abs(pixels - 255).sum(axis=-1) > OFF_WHITE
    if drawn.sum() < MIN_PIXELS:
        return Reading(None, None, None, None, clean=not drawn.any())
    blob = _largest_blob(drawn)
    typical = np.median(pixels[blob], axis=0)
    colour = min(COLORS, key=lambda name: float(np.square(np.array(COLORS[name]) - typical).sum()))
    ys, xs = np.nonzero(blob)
    height, width = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = len(ys) / (height * width)
    shape = min(FILL, key=lambda name: abs(FILL[name] - fill))
    scale = pixels.shape[0] / IMAGE_SIZE
    size = "large" if max(height, width) > SIZE_BOUNDARY * pixels.shape[0] else "small"
    centre = np.array([xs.mean(), ys.mean()]) / pixels.shape[1::-1]
    position = min(POSITIONS, key=lambda name: float(np.square(np.array(POSITIONS[name]) - centre).sum()))
    stray = drawn & ~_grow(blob, max(1, round(RIM * scale)))
    return Reading(colour, shape, size, position, clean=int(stray.sum()) <= STRAY_PIXELS * scale * scale)


def read_image(image: np.ndarray) -> tuple[str | None, str | None]:
    """(colour, shape) of an image; (None, None) if nothing stands out."""
    reading = read_scene(image)
    return reading.colour, reading.shape


def _grow(mask: np.ndarray, steps: int) -> np.ndarray:
    grown = mask.copy()
    for _ in range(steps):
        step = grown.copy()
        step[1:] |= grown[:-1]
        step[:-1] |= grown[1:]
        step[:, 1:] |= grown[:, :-1]
        step[:, :-1] |= grown[:, 1:]
        grown = step
    return grown


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


# A video's motion: the way its shape's centroid moved from the first frame to the last, along the axis it
# moved most; under this share of the image, it stood still (None).
MIN_TRAVEL = 0.1
MOTION_NAMES = {(1, 0): "moving to the right", (-1, 0): "moving to the left", (0, -1): "moving up",
                (0, 1): "moving down"}


@dataclass(frozen=True)
class VideoReading:
    scene: Reading  # what the middle frame shows
    motion: str | None


def read_video(frames: np.ndarray) -> VideoReading:
    """What a video (frames x H x W x 3, floats in [0, 1] or uint8) shows: its middle frame's reading, and
    which way its shape moved (None: nothing to follow, or no clear move)."""
    frames = np.asarray(frames)
    first, last = _centroid(frames[0]), _centroid(frames[-1])
    motion = None
    if first is not None and last is not None:
        dx, dy = last - first
        if max(abs(dx), abs(dy)) >= MIN_TRAVEL:
            motion = MOTION_NAMES[(int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))]
    return VideoReading(read_scene(frames[len(frames) // 2]), motion)


def _centroid(image: np.ndarray) -> np.ndarray | None:
    """The largest blob's centroid (x, y) as shares of the image; None if nothing stands out."""
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.max() <= 1.0:
        pixels = pixels * 255
    drawn = np.abs(pixels - 255).sum(axis=-1) > OFF_WHITE
    if drawn.sum() < MIN_PIXELS:
        return None
    ys, xs = np.nonzero(_largest_blob(drawn))
    return np.array([xs.mean(), ys.mean()]) / pixels.shape[1::-1]
