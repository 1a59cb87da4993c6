"""Draws docs/images/<model>.png: a built-in model on every colour x shape prompt.

One column per colour, one row per shape, on the seeds the meaning test gives those prompts
(dvllm.tiny_shapes.meaning: 1000 and up, never used in training), at the model's default steps and
guidance: what a newcomer gets, not a pick.

    python scripts/make_readme_image.py tiny-shapes tiny-shapes-dit
"""
from __future__ import annotations

import argparse
import os

from PIL import Image, ImageDraw

from dvllm import DiffusionEngine, SamplingParams
from dvllm.tiny_shapes.data import COLORS, SHAPES
from dvllm.tiny_shapes.meaning import cases

OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "images")


def draw(model: str) -> str:
    plain = cases(forms=("plain",))
    outs = DiffusionEngine(model=model, max_batch_size=64).generate(
        [c.prompt for c in plain], [SamplingParams(seed=c.seed) for c in plain], use_tqdm=False)
    tile, pad, top, left = 80, 6, 18, 58
    columns, rows = len(COLORS), len(SHAPES)
    sheet = Image.new("RGB", (left + columns * (tile + pad), top + rows * (tile + pad)), "white")
    pen = ImageDraw.Draw(sheet)
    for c, colour in enumerate(COLORS):
        pen.text((left + c * (tile + pad) + 4, 3), colour, fill=(60, 60, 60))
    for r, shape in enumerate(SHAPES):
        pen.text((4, top + r * (tile + pad) + tile // 2 - 6), shape, fill=(60, 60, 60))
    for case, out in zip(plain, outs):
        c, r = list(COLORS).index(case.colour), SHAPES.index(case.shape)
        corner = (left + c * (tile + pad), top + r * (tile + pad))
        sheet.paste(out.images[0].resize((tile, tile), Image.NEAREST), corner)
    path = os.path.join(OUT, f"{model}.png")
    sheet.save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["tiny-shapes"])
    for model in parser.parse_args().models:
        print(f"wrote {draw(model)}")


if __name__ == "__main__":
    main()
