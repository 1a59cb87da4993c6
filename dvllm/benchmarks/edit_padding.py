"""Padded versus grouped: the cost of one denoiser step over edits whose input images differ in size.

    python -m dvllm.benchmarks.edit_padding --model qwen-image-edit-cpu --size 64 --rounds 5

The same rows (requests of three input aspect ratios, one or two images each) go through the edit
adapter's denoise three ways, interleaved round by round: dvllm's (one call per image count, rows of
other shapes padded within it, per-row rotary positions), all padded (one call, every row padded to
the longest), and grouped (one call per distinct set of input shapes, nothing padded). Reports the
median seconds of each against grouped's. The model loads with dummy weights: timing needs the
architecture, not trained values.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from PIL import Image

from dvllm.models.layout import BatchLayout
from dvllm.models.loader import load_adapter

# (width, height) of each request's input images: three aspects, one or two images a request
INPUTS = [((64, 48),), ((48, 64),), ((64, 64), (48, 64)), ((64, 48),), ((80, 48),), ((48, 64), (64, 48))]


def rows(adapter, size: int) -> tuple:
    """Latents, timesteps and conditions of one row per request in INPUTS (zero text: the cost is the same)."""
    info = adapter.info
    generator = torch.Generator("cpu").manual_seed(0)
    count = len(INPUTS) if info.images.max_images > 1 else sum(len(i) == 1 for i in INPUTS)
    inputs = [i for i in INPUTS if info.images.max_images > 1 or len(i) == 1][:count]
    latents, image_inputs, grids = [], [], []
    for sizes in inputs:
        images = tuple(Image.new("RGB", wh, (100, 150, 200)) for wh in sizes)
        noise, packed = adapter.prepare_edit(images, 1, size, size, generator)
        latents.append(noise)
        image_inputs.append(packed[0])
        grids.append(tuple(x for grid in info.images.edit_grids(sizes) for x in grid))
    longest = max(len(x) for x in image_inputs)
    conditions = {k: torch.zeros((len(inputs), *shape)) for k, shape in info.text.condition_shapes.items()}
    conditions["prompt_embeds_mask"][:, :32] = 1  # a 32-token prompt
    conditions["image_inputs"] = torch.stack([torch.nn.functional.pad(x, (0, longest - len(x))) for x in image_inputs])
    layout = BatchLayout.single((size, size), len(inputs), image_grids=tuple(grids),
                                text_lengths=((32, 32),) * len(inputs))
    return torch.cat(latents), torch.full((len(inputs),), 500.0), conditions, layout


def grouped(adapter, latents, timesteps, conditions, layout: BatchLayout) -> torch.Tensor:
    grids = layout.row_grids

    def call(rows: list[int], index: torch.Tensor) -> torch.Tensor:
        return adapter._call(latents[index], timesteps[index], {k: v[index] for k, v in conditions.items()},
                             [adapter._shapes(grids[rows[0]], layout.image_size)] * len(rows),
                             [layout.row_text_lengths[i] for i in rows])

    return adapter.call_per_group(grids, latents, call)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen-image-edit-cpu")
    p.add_argument("--size", type=int, default=64, help="output height and width (default: 64)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    adapter = load_adapter(args.model, "dummy", torch.device("cpu"), torch.float32)
    latents, timesteps, conditions, layout = rows(adapter, args.size)
    ways = {"dvllm": lambda: adapter.denoise(latents, timesteps, conditions, timesteps, layout),
            "padded": lambda: adapter.padded_denoise(latents, timesteps, conditions, layout),
            "grouped": lambda: grouped(adapter, latents, timesteps, conditions, layout)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        reference = ways["grouped"]()
        same = max(float((ways[name]() - reference).abs().max()) for name in ("dvllm", "padded"))
        for _ in range(args.rounds):
            for name, run in ways.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    groups = len(set(layout.row_grids))
    print(f"{args.model}: {len(latents)} rows, {groups} input-shape sets, output {args.size}x{args.size}; "
          f"largest difference from grouped {same:.2e}; median of {args.rounds} interleaved rounds:")
    for name in ("dvllm", "padded"):
        print(f"  {name} {median[name]:.3f} s, grouped {median['grouped']:.3f} s: "
              f"{median[name] / median['grouped']:.2f}x grouped's time")


if __name__ == "__main__":
    main()
