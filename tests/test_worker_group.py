"""Worker groups (sequence_parallel_size): the worker and a member process run each denoiser forward together, every
row's tokens split between them (diffusers' context parallelism, Ulysses over gloo). The images equal one worker's
for each family diffusers has a plan for, batched with other sizes and step counts, preempted or not; a member
killed in the middle of a forward, or between requests, loses nothing; what a group does not serve is refused."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch.distributed as dist

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.parallel.parallel_config import ParallelConfig

TOL = 1e-5  # the bound on the CPU in float32; measured: about 1e-7

# Sizes of other token counts ride together (16x48: 3 tokens of a real Flux; the tiny Flux's 48, even: odd counts
# and fewer tokens than the group are tests/test_uneven_split.py's)
PROMPTS = ["a red circle", "a blue square on a green field", "a star"]


def _params(family: str) -> list[SamplingParams]:
    sizes, steps = [(32, 32), (48, 32), (16, 48)], [3, 4, 2]
    extra = {"negative_prompt": "blurry", "guidance_scale": 4.0} if family == "qwen" else {"guidance_scale": 3.5}
    return [SamplingParams(num_inference_steps=n, seed=i, height=h, width=w, output_type="np", **extra)
            for i, ((h, w), n) in enumerate(zip(sizes, steps))]


def _images(engine: DiffusionEngine, prompts: list[str], params: list[SamplingParams]) -> list[np.ndarray]:
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.images[0] for o in outs]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert float(np.abs(a - b).max()) <= TOL


def _block_tokens(transformer) -> list[int]:
    """The image tokens the transformer's last block sees, one entry per forward from now on."""
    tokens: list[int] = []
    transformer.transformer_blocks[-1].register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    return tokens


def _group(engine: DiffusionEngine):
    return engine.executor.worker.group


@pytest.mark.parametrize("family, fixture", [("flux", "flux_path"), ("qwen", "qwen_image_path")])
@pytest.mark.slow
def test_a_group_of_two_gives_the_one_worker_images(family, fixture, request):
    model, params = request.getfixturevalue(fixture), _params(family)
    alone = DiffusionEngine(model=model, device="cpu", dtype="float32")
    try:
        whole = _block_tokens(alone.executor.worker.runner.adapter.pipeline.transformer)
        want = _images(alone, PROMPTS, params)
    finally:
        alone.shutdown()
    engine = DiffusionEngine(model=model, device="cpu", dtype="float32", sequence_parallel_size=2)
    try:
        group = _group(engine)
        sliced = _block_tokens(group.denoiser)
        _assert_close(_images(engine, PROMPTS, params), want)
        assert sliced == [(n + 1) // 2 for n in whole], (sliced, whole)  # split, not run whole by each member
        assert group.restarts == 0 and all(m.alive for m in group.members)
    finally:
        engine.shutdown()
    assert not dist.is_initialized() and not any(m.alive for m in group.members)


@pytest.mark.slow
def test_a_member_killed_mid_forward_or_idle_loses_nothing(flux_path):
    params = _params("flux")
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", sequence_parallel_size=2)
    try:
        group = _group(engine)
        want = _images(engine, PROMPTS, params)
        member, kills = group.members[0], []

        def kill_once(module, args, kwargs):  # runs after the call went to the member: it dies inside the forward
            if not kills:
                kills.append(member.pid)
                os.kill(member.pid, signal.SIGKILL)
                member.process.wait()

        hook = group.denoiser.register_forward_pre_hook(kill_once, with_kwargs=True)
        _assert_close(_images(engine, PROMPTS, params), want)
        hook.remove()
        assert group.restarts == 1 and member.alive and member.pid != kills[0]
        os.kill(member.pid, signal.SIGKILL)  # idle: the next call finds its pipe closed
        member.process.wait()
        _assert_close(_images(engine, PROMPTS, params), want)
        assert group.restarts == 2 and member.alive
        assert engine.stats()["stage_restarts"]["worker_group.members"] == 2  # (dvllm_stage_restarts)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_grouped_request_preempted_comes_back_with_the_same_image(flux_path):
    low = SamplingParams(num_inference_steps=6, guidance_scale=3.5, seed=7, height=32, width=32, output_type="np",
                         priority=5)
    urgent = SamplingParams(num_inference_steps=3, guidance_scale=3.5, seed=8, height=32, width=32, n=2,
                            output_type="np", priority=0)
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", sequence_parallel_size=2,
                             scheduling_policy="priority", max_batch_size=2)
    try:
        alone = _images(engine, ["a red circle"], [low])
        engine.add_request("low", "a red circle", low)
        finals = {}
        for _ in range(2):
            for out in engine.step():
                finals[out.request_id] = out
        engine.add_request("urgent", "a blue square", urgent)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert engine.stats()["num_preemptions"] >= 1, "the urgent request must preempt the grouped one"
        assert finals["low"].error is None, finals["low"].error
        _assert_close(finals["low"].images, alone)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_what_a_group_does_not_serve_is_refused(flux_path, sd3_path):
    for kwargs, match in [
            (dict(compile="dynamic"), "does not serve compile"),
            (dict(sequence_parallel_size=4, ring_degree=2), "ring_degree must be 1"),
            (dict(group_devices="cpu,cpu"), "names 2 device"),
            (dict(group_devices="tpu"), "is not 'cpu' or 'cuda:N'"),
            (dict(group_timeout_s=0), "group_timeout_s must be"),
            (dict(sequence_parallel_size=0), "sequence_parallel_size")]:
        with pytest.raises(ValueError, match=match):
            ParallelConfig.of(EngineConfig(**{"sequence_parallel_size": 2, **kwargs}))
    with pytest.raises(ValueError, match="group_devices is set"):
        ParallelConfig.of(EngineConfig(group_devices="cpu"))
    with pytest.raises(ValueError, match="no context-parallel plan"):  # before any member starts
        DiffusionEngine(model=sd3_path, device="cpu", sequence_parallel_size=2)
    assert not dist.is_initialized()
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", sequence_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="leads one worker group"):  # one torch.distributed group a process
            DiffusionEngine(model=flux_path, device="cpu", sequence_parallel_size=2)
    finally:
        engine.shutdown()


def test_a_worker_that_fails_to_start_takes_its_group_down(flux_path, monkeypatch):
    """The members and the process group started before the failure go with the worker."""
    import dvllm.parallel.group as group_module
    import dvllm.executor.worker as worker_module

    groups = []
    real = group_module.WorkerGroup.__init__

    def init(self, *args):
        groups.append(self)
        real(self, *args)

    monkeypatch.setattr(group_module.WorkerGroup, "__init__", init)

    def no_pool(*args):
        raise RuntimeError("no room for the pool")

    monkeypatch.setattr(worker_module, "create_state_pool", no_pool)
    with pytest.raises(RuntimeError, match="no room"):
        DiffusionEngine(model=flux_path, device="cpu", dtype="float32", sequence_parallel_size=2)
    assert groups and not any(m.alive for m in groups[0].members) and not dist.is_initialized()

