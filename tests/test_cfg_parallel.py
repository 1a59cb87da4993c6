"""CFG-parallel (cfg_parallel_size): a group of the worker and a member process splits each forward's rows, so a
CFG request's conditional row runs on one and its unconditional row on the other. Every family, the ones diffusers
has no context-parallel plan for included: the images equal one worker's within 1e-5, for batches of CFG and
guidance-free requests of other sizes and steps (an odd row count: uneven slices); a member killed mid-forward
loses nothing."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch.distributed as dist

from dvllm import DiffusionEngine, SamplingParams
from dvllm.parallel.row_split import call_rows, chunk, cut

TOL = 1e-5

PROMPTS = ["a red circle", "a blue square on a green field", "a star"]


def _params(family: str) -> list[SamplingParams]:
    """Two CFG requests and one without (3 + 2 rows: the cut falls inside the conditional block)."""
    guidance = [5.0, 1.0 if family != "z-image" else 0.0, 4.0]
    sizes, steps = [(32, 32), (32, 32), (32, 32)], [3, 2, 4]
    negative = {"negative_prompt": "blurry"}
    return [SamplingParams(num_inference_steps=n, seed=i, height=h, width=w, guidance_scale=g, output_type="np",
                           **negative) for i, ((h, w), n, g) in enumerate(zip(sizes, steps, guidance))]


def _images(engine: DiffusionEngine, params: list[SamplingParams]) -> list[np.ndarray]:
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.images[0] for o in outs]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL


def _denoiser(engine: DiffusionEngine):
    pipeline = engine.executor.worker.runner.adapter.pipeline
    return getattr(pipeline, "transformer", None) or pipeline.unet


@pytest.mark.parametrize("family, fixture", [("sdxl", "sdxl_path"), ("sd3", "sd3_path"),
                                             ("z-image", "z_image_path"), ("qwen", "qwen_image_path")])
@pytest.mark.slow
def test_a_cfg_parallel_group_gives_the_one_worker_images(family, fixture, request):
    model, params = request.getfixturevalue(fixture), _params(family)
    alone = DiffusionEngine(model=model, device="cpu", dtype="float32")
    try:
        want = _images(alone, params)
    finally:
        alone.shutdown()
    engine = DiffusionEngine(model=model, device="cpu", dtype="float32", cfg_parallel_size=2)
    try:
        rows = []  # the rows the worker's own denoiser runs, against the call's
        _denoiser(engine).register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(call_rows(args, kwargs)), with_kwargs=True)
        _assert_close(_images(engine, params), want)
        assert rows and max(rows) < 5, rows  # the first step's 5 rows: 3 on the worker, 2 on the member
        assert engine.executor.worker.group.restarts == 0
    finally:
        engine.shutdown()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_member_killed_mid_forward_loses_nothing(sdxl_path):
    params = _params("sdxl")
    engine = DiffusionEngine(model=sdxl_path, device="cpu", dtype="float32", cfg_parallel_size=2)
    try:
        group = engine.executor.worker.group
        want = _images(engine, params)
        member, kills = group.members[0], []

        def kill_once(module, args, kwargs):  # after the call went to the member
            if not kills:
                kills.append(member.pid)
                os.kill(member.pid, signal.SIGKILL)
                member.process.wait()

        _denoiser(engine).register_forward_pre_hook(kill_once, with_kwargs=True)
        _assert_close(_images(engine, params), want)
        assert group.restarts == 1 and member.alive and member.pid != kills[0]
    finally:
        engine.shutdown()


def test_rows_are_cut_in_contiguous_slices_and_shared_positions_are_kept():
    assert [chunk(5, r, 2) for r in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [chunk(1, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 1)]
    import torch

    args, kwargs = cut((torch.arange(4), [1, 2, 3, 4]), {"img_ids": torch.zeros(4, 3), "t": torch.tensor(0.5),
                                                         "added": {"time_ids": torch.ones(4, 6)}}, 4, slice(1, 3))
    assert args[0].tolist() == [1, 2] and args[1] == [2, 3]
    assert kwargs["img_ids"].shape == (4, 3) and kwargs["t"].dim() == 0 and kwargs["added"]["time_ids"].shape == (2, 6)
