"""Wan videos in a worker group: a sequence-parallel group of two splits every row's video tokens (diffusers'
context-parallel plan for WanTransformer3DModel), a CFG-parallel one splits the rows; both give one worker's
latents, for videos of other sizes and frame counts batched together, with one expert and with Wan 2.2 A14B's two
(each call shared with the expert it runs)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist
from conftest import tiny_wan_pipeline
from lora_utils import make_lora

from dvllm import DiffusionEngine, SamplingParams

TOL = 1e-5  # the group's bound on the CPU in float32
PROMPTS = ["a red circle moving to the right", "a blue square", "a star"]


def _params(steps: tuple[int, ...] = (3, 4, 2)) -> list[SamplingParams]:
    shapes = [(32, 32, 9), (16, 32, 5), (32, 16, 9)]  # 12, 4 and 6 video tokens a row
    return [SamplingParams(num_inference_steps=n, seed=i, height=h, width=w, num_frames=f, guidance_scale=4.0,
                           output_type="latent") for i, ((h, w, f), n) in enumerate(zip(shapes, steps))]


def _latents(engine: DiffusionEngine, steps: tuple[int, ...] = (3, 4, 2), lora: bool = False) -> list[np.ndarray]:
    params = _params(steps)
    if lora:  # the first request's rows with an adapter, beside rows without
        params[0] = dataclasses.replace(params[0], loras={"l": 1.0})
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.images[0].numpy() for o in outs]


def _block_tokens(transformer) -> list[int]:
    """The video tokens the transformer's last block sees, one entry per call from now on."""
    tokens: list[int] = []
    transformer.blocks[-1].register_forward_pre_hook(lambda module, args: tokens.append(args[0].shape[1]))
    return tokens


@pytest.mark.parametrize("split", [{"sequence_parallel_size": 2}, {"cfg_parallel_size": 2}])
@pytest.mark.slow
def test_a_group_of_two_gives_one_workers_videos(wan_path, split):
    alone = DiffusionEngine(model=wan_path, device="cpu", dtype="float32")
    try:
        whole = _block_tokens(alone.executor.worker.runner.adapter.pipeline.transformer)
        want = _latents(alone)
    finally:
        alone.shutdown()
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", **split)
    try:
        group = engine.executor.worker.group
        seen = _block_tokens(group.denoiser)
        got = _latents(engine)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL
        if "sequence_parallel_size" in split:  # every row's tokens split, not run whole by each process
            assert seen == [(n + 1) // 2 for n in whole], (seen, whole)
        else:
            assert group.forwards["rows"] > 0
        assert group.restarts == 0 and all(m.alive for m in group.members)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize("split", [{"sequence_parallel_size": 2}, {"cfg_parallel_size": 2}])
@pytest.mark.slow
def test_two_experts_in_a_group_of_two_give_one_workers_videos(tmp_path_factory, split):
    """Wan 2.2 A14B: both experts' calls are shared with the members (which hold both), each naming its expert;
    videos whose steps cross the boundary, one with a LoRA adapter, equal one worker's."""
    folder = tmp_path_factory.mktemp("tiny-wan-a14b-in-group")
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.save_pretrained(folder / "model")
    path, loras = str(folder / "model"), {"l": make_lora(pipe, str(folder / "lora"), seed=1)}
    steps = (6, 4, 3)  # each crosses the boundary (875) in its own step
    alone = DiffusionEngine(model=path, device="cpu", dtype="float32", lora_modules=loras)
    try:
        pipe = alone.executor.worker.runner.adapter.pipeline
        whole = [_block_tokens(pipe.transformer), _block_tokens(pipe.transformer_2)]
        want = _latents(alone, steps, lora=True)
    finally:
        alone.shutdown()
    assert all(whole), whole  # both experts ran
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", lora_modules=loras, **split)
    try:
        group = engine.executor.worker.group
        assert len(group.denoisers) == 2
        seen = [_block_tokens(denoiser) for denoiser in group.denoisers]
        got = _latents(engine, steps, lora=True)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL
        if "sequence_parallel_size" in split:  # each expert's tokens split: shared, not run whole by the worker
            for expert, (mine, all_tokens) in enumerate(zip(seen, whole)):
                assert mine == [(n + 1) // 2 for n in all_tokens], (expert, mine, all_tokens)
        else:
            assert group.forwards["rows"] == sum(len(calls) for calls in seen) and group.forwards["alone"] == 0
        assert group.restarts == 0 and all(m.alive for m in group.members)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
