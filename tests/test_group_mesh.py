"""Both splits at once: a group of sequence_parallel_size x cfg_parallel_size processes is a mesh of row groups,
each a run of ranks that splits its slice of the rows' tokens. Qwen-Image (true CFG, a context-parallel plan) on
2 x 2 gives one worker's images within 1e-5, LoRA rows included, with every process running half of the rows'
tokens; a member killed mid-forward forms the mesh anew and loses nothing."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch.distributed as dist
from conftest import tiny_qwen_image_pipeline
from lora_utils import make_lora

from dvllm import DiffusionEngine, EngineConfig, SamplingParams
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.parallel.row_split import call_rows

TOL = 1e-5
PROMPTS = ["a red circle", "a blue square on a green field", "a star"]
MESH = dict(sequence_parallel_size=2, cfg_parallel_size=2)


@pytest.fixture(scope="module")
def qwen_lora(tmp_path_factory) -> dict[str, str]:
    return {"a": make_lora(tiny_qwen_image_pipeline(), str(tmp_path_factory.mktemp("mesh-lora")), seed=31)}


def _params() -> list[SamplingParams]:
    """Two true-CFG requests and one without (3 + 2 rows: the row groups get 3 and 2), one with an adapter."""
    return [SamplingParams(num_inference_steps=n, seed=i, height=32, width=32, guidance_scale=g, output_type="np",
                           negative_prompt="blurry", loras=lo)
            for i, (n, g, lo) in enumerate([(3, 5.0, {"a": 0.8}), (2, 1.0, None), (4, 4.0, None)])]


def _images(engine: DiffusionEngine) -> list[np.ndarray]:
    outs = engine.generate(PROMPTS, _params(), use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.images[0] for o in outs]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL


def _one_worker(model: str, loras: dict[str, str]) -> list[np.ndarray]:
    alone = DiffusionEngine(model=model, device="cpu", dtype="float32", lora_modules=loras)
    try:
        return _images(alone)
    finally:
        alone.shutdown()


@pytest.mark.slow
def test_a_mesh_of_row_groups_gives_the_one_worker_images(qwen_image_path, qwen_lora):
    want = _one_worker(qwen_image_path, qwen_lora)
    engine = DiffusionEngine(model=qwen_image_path, device="cpu", dtype="float32", lora_modules=qwen_lora, **MESH)
    try:
        transformer = engine.executor.worker.runner.adapter.pipeline.transformer
        rows, tokens = [], []  # the worker's own call rows, and the tokens its second block gets (the split's)
        transformer.register_forward_pre_hook(lambda m, a, kw: rows.append(call_rows(a, kw)), with_kwargs=True)
        transformer.transformer_blocks[1].register_forward_pre_hook(
            lambda m, a, kw: tokens.append(kw["hidden_states"].shape[1]), with_kwargs=True)
        _assert_close(_images(engine), want)
        group = engine.executor.worker.group
        assert rows and max(rows) == 3, rows  # the first step's 5 rows: 3 on the worker's row group
        assert set(tokens) == {8}, tokens  # 32x32: 16 image tokens a row, half on each rank of a row group
        assert group.forwards["rows"] > 0 and group.forwards["tokens"] == 0 and group.restarts == 0
    finally:
        engine.shutdown()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_member_killed_mid_forward_forms_the_mesh_anew(qwen_image_path, qwen_lora):
    want = _one_worker(qwen_image_path, qwen_lora)
    engine = DiffusionEngine(model=qwen_image_path, device="cpu", dtype="float32", lora_modules=qwen_lora, **MESH)
    try:
        group = engine.executor.worker.group
        member, kills = group.members[2], []  # rank 3: the second row group's token partner

        def kill_once(module, args, kwargs):  # after the call went to the member
            if not kills:
                kills.append(member.pid)
                os.kill(member.pid, signal.SIGKILL)

        group.denoiser.register_forward_pre_hook(kill_once, with_kwargs=True)
        _assert_close(_images(engine), want)
        assert group.restarts == 1 and member.alive and member.pid != kills[0]
    finally:
        engine.shutdown()


def test_the_elastic_policy_is_refused_on_a_mesh():
    with pytest.raises(ValueError, match="cfg_parallel_size 1"):
        ParallelConfig.of(EngineConfig(group_policy="elastic", **MESH))
