"""Draws docs/images/tiny-shapes.png: what the built-in model makes for a few prompts (seed 0)."""
from __future__ import annotations

import os

from PIL import Image, ImageDraw

from dvllm import DiffusionEngine, SamplingParams

PROMPTS = ["a red circle", "a blue square", "a green triangle", "an orange star",
           "a small purple circle on the left", "a large yellow square", "a pink star at the top",
           "a black triangle on the right"]
OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "images", "tiny-shapes.png")


def main() -> None:
    outs = DiffusionEngine().generate(PROMPTS, SamplingParams(seed=0), use_tqdm=False)
    tile, pad, label = 128, 8, 34
    sheet = Image.new("RGB", (len(PROMPTS) * (tile + pad) + pad, tile + label + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        x = pad + i * (tile + pad)
        sheet.paste(out.images[0].resize((tile, tile), Image.NEAREST), (x, pad))
        words = prompt.split()
        for line, text in enumerate((" ".join(words[:3]), " ".join(words[3:]))):
            draw.text((x, pad + tile + 4 + 12 * line), text, fill=(60, 60, 60))
    sheet.save(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
