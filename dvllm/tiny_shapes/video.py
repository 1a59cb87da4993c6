"""The tiny-shapes videos: one shape in a named colour and size moving in a straight line (to the
right, to the left, up or down) across the frame, on a white background. Deterministic."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from dvllm.tiny_shapes.data import BACKGROUND, COLORS, IMAGE_SIZE, SHAPES, SIZES, _outline, vocabulary

NUM_FRAMES = 9  # the Wan VAE keeps the first frame and packs each 4 after it: 3 latent frames
VIDEO_SIZE = 32  # the built-in video model's frames: 32x32 px (the images' scenes drawn at half size)
# motion -> (start, end) of the shape's centre, as shares of the image: it crosses the middle 40%
MOTIONS = {
    "moving to the right": ((0.3, 0.5), (0.7, 0.5)),
    "moving to the left": ((0.7, 0.5), (0.3, 0.5)),
    "moving up": ((0.5, 0.7), (0.5, 0.3)),
    "moving down": ((0.5, 0.3), (0.5, 0.7)),
}


@dataclass(frozen=True)
class VideoScene:
    color: str
    shape: str
    size: str
    motion: str

    def caption(self, rng: random.Random) -> str:
        """Colour and shape always; the motion mostly, the size and background sometimes."""
        words = ([self.size] if rng.random() < 0.5 else []) + [self.color, self.shape]
        if rng.random() < 0.8:
            words.append(self.motion)
        text = ("an " if words[0][0] in "aeiou" else "a ") + " ".join(words)
        if rng.random() < 0.2:
            text += ", on a white background"
        return text

    def render(self, frames: int = NUM_FRAMES, size: int = IMAGE_SIZE) -> list[Image.Image]:
        (x0, y0), (x1, y1) = MOTIONS[self.motion]
        r = SIZES[self.size] * size / 2 * 1.6
        out = []
        for i in range(frames):
            f = i / (frames - 1)
            image = Image.new("RGB", (size, size), BACKGROUND)
            cx, cy = (x0 + (x1 - x0) * f) * size, (y0 + (y1 - y0) * f) * size
            ImageDraw.Draw(image).polygon(_outline(self.shape, cx, cy, r), fill=COLORS[self.color])
            out.append(image)
        return out


def all_video_scenes() -> list[VideoScene]:
    return [VideoScene(*combo) for combo in itertools.product(COLORS, SHAPES, SIZES, MOTIONS)]


def render_all_videos(scenes: list[VideoScene], size: int = IMAGE_SIZE) -> torch.Tensor:
    """[N, 3, frames, size, size] in [-1, 1], as the Wan VAE takes videos."""
    pixels = np.stack([np.stack([np.asarray(f, dtype=np.float32) for f in s.render(size=size)]) for s in scenes])
    return torch.from_numpy(pixels / 127.5 - 1.0).permute(0, 4, 1, 2, 3)


def video_vocabulary() -> list[str]:
    words = set(vocabulary()) | {","}
    for motion in MOTIONS:
        words.update(motion.split())
    return sorted(words)
