"""The built-in model makes what it is asked for: colour and shape, read back with plain image
arithmetic, over every colour x shape prompt, in one mixed batch at the model's defaults."""
from __future__ import annotations

import itertools

import numpy as np

from dvllm import DiffusionEngine, SamplingParams
from dvllm.tiny_shapes.data import COLORS, SHAPES
from shape_checker import read_image


def prompt(colour: str, shape: str) -> str:
    return f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}"


def test_default_model_draws_the_colour_and_shape_asked_for(capsys):
    engine = DiffusionEngine()  # the built-in default: tiny-shapes
    assert engine.model_info.name == "tiny-shapes"
    cases = list(itertools.product(COLORS, SHAPES))  # 8 x 4 = 32 prompts
    outs = engine.generate([prompt(c, s) for c, s in cases],
                           [SamplingParams(seed=i, output_type="np") for i in range(len(cases))], use_tqdm=False)
    reads = [read_image(o.images[0]) for o in outs]
    colour_ok = sum(r[0] == c for r, (c, _) in zip(reads, cases)) / len(cases)
    shape_ok = sum(r[1] == s for r, (_, s) in zip(reads, cases)) / len(cases)
    with capsys.disabled():
        print(f"\ntiny-shapes on {len(cases)} prompts: colour right {colour_ok:.0%}, shape right {shape_ok:.0%}")
    assert colour_ok >= 0.9
    assert shape_ok >= 0.7


def test_the_checker_reads_every_training_scene_right():
    """The reader must be right on the ground truth before it may judge the model."""
    from dvllm.tiny_shapes.data import POSITIONS, SIZES, Scene

    scenes = [Scene(c, s, z, p) for c, s, z, p in itertools.product(COLORS, SHAPES, SIZES, POSITIONS)]
    wrong = [(sc.color, sc.shape, read_image(np.asarray(sc.render()))) for sc in scenes
             if read_image(np.asarray(sc.render())) != (sc.color, sc.shape)]
    assert not wrong, wrong[:5]
