"""The tiny-shapes data: one flat shape in a named colour, size and position on a white
background, with a caption built from its attributes. Deterministic from a seed."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

IMAGE_SIZE = 64
BACKGROUND = (255, 255, 255)
COLORS = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
    "orange": (245, 130, 20), "purple": (140, 40, 170), "black": (20, 20, 20), "pink": (240, 110, 180),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = {"small": 0.22, "large": 0.40}  # the shape's radius, as a share of the image
POSITIONS = {"on the left": (0.3, 0.5), "on the right": (0.7, 0.5), "at the top": (0.5, 0.3),
             "at the bottom": (0.5, 0.7), "in the center": (0.5, 0.5)}


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    size: str
    position: str

    def caption(self, rng: random.Random) -> str:
        """A caption naming colour and shape always, and size, position and background sometimes,
        so that both "a red circle" and the long form are prompts the model knows."""
        words = ([self.size] if rng.random() < 0.5 else []) + [self.color, self.shape]
        if rng.random() < 0.5:
            words.append(self.position)
        text = ("an " if words[0][0] in "aeiou" else "a ") + " ".join(words)
        if rng.random() < 0.3:
            text += ", on a white background"
        return text

    def render(self, size: int = IMAGE_SIZE) -> Image.Image:
        image = Image.new("RGB", (size, size), BACKGROUND)
        cx, cy = (v * size for v in POSITIONS[self.position])
        r = SIZES[self.size] * size / 2 * 1.6
        ImageDraw.Draw(image).polygon(_outline(self.shape, cx, cy, r), fill=COLORS[self.color])
        return image


def _outline(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "circle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (2 * math.pi * i / 48 for i in range(48))]
    if shape == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2 + 2 * math.pi * i / 3 for i in range(3))]
    points = []  # a five-pointed star
    for i in range(10):
        radius = r if i % 2 == 0 else r * 0.45
        angle = -math.pi / 2 + math.pi * i / 5
        points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
    return points


def random_scene(rng: random.Random) -> Scene:
    return Scene(rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(list(SIZES)), rng.choice(list(POSITIONS)))


def vocabulary() -> list[str]:
    """Every word a caption can use."""
    words = {"a", "an", "on", "the", "white", "background"}
    for text in [*COLORS, *SHAPES, *SIZES, *POSITIONS]:
        words.update(text.split())
    return sorted(words)
