"""Wan videos in a worker group: a sequence-parallel group of two splits every row's video tokens (diffusers'
context-parallel plan for WanTransformer3DModel), a CFG-parallel one splits the rows; both give one worker's
latents, for videos of other sizes and frame counts batched together."""
from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from dvllm import DiffusionEngine, SamplingParams

TOL = 1e-5  # the group's bound on the CPU in float32
PROMPTS = ["a red circle moving to the right", "a blue square", "a star"]


def _params() -> list[SamplingParams]:
    shapes = [(32, 32, 9), (16, 32, 5), (32, 16, 9)]  # 12, 4 and 6 video tokens a row
    return [SamplingParams(num_inference_steps=n, seed=i, height=h, width=w, num_frames=f, guidance_scale=4.0,
                           output_type="latent") for i, ((h, w, f), n) in enumerate(zip(shapes, [3, 4, 2]))]


def _latents(engine: DiffusionEngine) -> list[np.ndarray]:
    outs = engine.generate(PROMPTS, _params(), use_tqdm=False)
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
