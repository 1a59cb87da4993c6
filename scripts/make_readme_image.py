"""Draws docs/images/tiny-shapes.png: the built-in model on the meaning test's 32 prompts.

One column per colour, one row per shape, seed = the prompt's index (as tests/test_meaning.py
runs them), at the model's default steps and guidance: what a newcomer gets, not a pick.
"""
from __future__ import annotations

import itertools
import os

from PIL import Image, ImageDraw

from dvllm import DiffusionEngine, SamplingParams
from dvllm.tiny_shapes.data import COLORS, SHAPES

OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "images", "tiny-shapes.png")


def prompt(colour: str, shape: str) -> str:
    return f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}"


def main() -> None:
    cases = list(itertools.product(COLORS, SHAPES))
    outs = DiffusionEngine().generate([prompt(c, s) for c, s in cases],
                                      [SamplingParams(seed=i) for i in range(len(cases))], use_tqdm=False)
    tile, pad, top, left = 80, 6, 18, 58
    columns, rows = len(COLORS), len(SHAPES)
    sheet = Image.new("RGB", (left + columns * (tile + pad), top + rows * (tile + pad)), "white")
    draw = ImageDraw.Draw(sheet)
    for c, colour in enumerate(COLORS):
        draw.text((left + c * (tile + pad) + 4, 3), colour, fill=(60, 60, 60))
    for r, shape in enumerate(SHAPES):
        draw.text((4, top + r * (tile + pad) + tile // 2 - 6), shape, fill=(60, 60, 60))
    for i, ((colour, shape), out) in enumerate(zip(cases, outs)):
        c, r = list(COLORS).index(colour), SHAPES.index(shape)
        sheet.paste(out.images[0].resize((tile, tile), Image.NEAREST), (left + c * (tile + pad), top + r * (tile + pad)))
    sheet.save(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
