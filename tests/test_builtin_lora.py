"""The LoRA shipped with dvllm, tiny-shapes-blue (scripts/train_tiny_shapes_lora.py): it loads by its bare name,
its images equal diffusers' after load_lora_weights, and it does what it claims: shapes of every other colour come
out blue, their shape kept, while the same prompts without it keep their colour."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.lora.files import LoraFilePolicy, LoraPathError, builtin_lora_folder, locate_lora
from dvllm.models.loader import builtin_folder
from dvllm.tiny_shapes.meaning import cases
from dvllm.tiny_shapes.reader import read_scene

TOL = 1e-3
NAME = "tiny-shapes-blue"
# The effect, over the plain prompts of every colour but blue x every shape, on held-out seeds 1000 and 2000 (56
# images): the shipped weights read 55 blue with the adapter and 0 without, shape right 56 with and 55 without
# (over all four prompt forms and seeds 1000, 2000, 3000: blue 333/336 with, 0/336 without). The bounds let a
# few reads flip on another BLAS.
SEEDS = (1000, 2000)
MIN_BLUE_WITH, MAX_BLUE_WITHOUT, MIN_SHAPE = 50, 3, 50


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusionEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as this module has always run; the rest of the suite gets its count back after
    engine = DiffusionEngine(device="cpu", dtype="float32", lora_modules={"blue": NAME}, max_batch_size=64)
    try:
        yield engine
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def test_a_bare_name_is_the_shipped_folder(tmp_path, monkeypatch):
    folder = builtin_lora_folder(NAME)
    assert folder is not None, f"{NAME} is not shipped (run scripts/train_tiny_shapes_lora.py)"
    monkeypatch.chdir(tmp_path)
    policy = LoraFilePolicy(max_mb=1)
    assert locate_lora(NAME, policy).path == locate_lora(folder, policy).path
    assert locate_lora(NAME, policy).size < 100_000  # small enough to ship in the package
    for other in ("tiny-shapes-red", "../loras", "loras"):  # an unknown bare name is still a missing path
        with pytest.raises(LoraPathError, match="does not exist"):
            locate_lora(other, policy)


@pytest.mark.slow
def test_matches_diffusers_after_load_lora_weights(engine):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(builtin_folder("tiny-shapes"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(builtin_lora_folder(NAME), adapter_name="blue")
    requests = [("a red circle", 1000, {"blue": 1.0}), ("a small green star on the left", 1001, {"blue": 1.0}),
                ("a red circle", 1000, None), ("an orange square", 1002, {"blue": 0.5})]
    call = dict(num_inference_steps=25, guidance_scale=1.5, height=64, width=64)
    params = [SamplingParams(seed=seed, loras=loras, output_type="np", **call) for _, seed, loras in requests]
    outs = engine.generate([prompt for prompt, _, _ in requests], params, use_tqdm=False)  # one mixed batch
    for (prompt, seed, loras), out in zip(requests, outs):
        assert out.error is None, out.error
        if loras:
            pipe.enable_lora()
            pipe.set_adapters(list(loras), adapter_weights=list(loras.values()))
        else:
            pipe.disable_lora()
        want = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **call).images[0]
        assert np.abs(out.images[0] - want).max() <= TOL, (prompt, loras)


@pytest.mark.slow
def test_every_shape_comes_out_blue(engine):
    asked = [c for seed in SEEDS for c in cases(forms=("plain",), seed=seed) if c.colour != "blue"]
    counts = {}
    for loras in (None, {"blue": 1.0}):
        params = [SamplingParams(seed=c.seed, loras=loras, output_type="np") for c in asked]
        outs = engine.generate([c.prompt for c in asked], params, use_tqdm=False)
        readings = [read_scene(o.images[0]) for o in outs]
        counts[bool(loras)] = (sum(r.colour == "blue" for r in readings),
                               sum(r.shape == c.shape for r, c in zip(readings, asked)))
    (blue_without, shape_without), (blue_with, shape_with) = counts[False], counts[True]
    assert len(asked) == 56
    assert blue_with >= MIN_BLUE_WITH and shape_with >= MIN_SHAPE, counts
    assert blue_without <= MAX_BLUE_WITHOUT and shape_without >= MIN_SHAPE, counts
