"""Deadlines and the elastic group policy: a request's deadline_s (HTTP `deadline`) is checked, reported per
request and counted; on an elastic group each step's forward is split by rows or by tokens as its rows pay, and
the images equal one worker's within 1e-5 whichever split each step took."""
from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from dvllm import DiffusionEngine, EngineConfig, SamplingParams
from dvllm.entrypoints.protocol import APIError, ImageGenerationRequest, engine_value_error
from dvllm.parallel.context_parallel import rows_split_pays
from dvllm.parallel.parallel_config import ParallelConfig

TOL = 1e-5
PROMPTS = ["a red circle", "a blue square on a green field", "a star", "a dog"]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_a_bad_deadline_is_refused(bad):
    with pytest.raises(ValueError, match="deadline_s must be"):
        SamplingParams(deadline_s=bad).validate()
    if not isinstance(bad, (bool, str)):
        with pytest.raises(APIError) as e:
            ImageGenerationRequest.parse({"prompt": "x", "deadline": bad})
        assert e.value.param == "deadline"


def test_the_http_deadline_is_the_requests_deadline_s():
    assert ImageGenerationRequest.parse({"prompt": "x", "deadline": 2.5}).sampling_params().deadline_s == 2.5
    assert ImageGenerationRequest.parse({"prompt": "x"}).sampling_params().deadline_s is None
    assert engine_value_error(ValueError("deadline_s must be ...")).param == "deadline"


def test_the_group_policy_is_checked():
    with pytest.raises(ValueError, match="group_policy must be one of"):
        ParallelConfig.of(EngineConfig(group_policy="wide"))
    with pytest.raises(ValueError, match="needs sequence_parallel_size > 1"):
        ParallelConfig.of(EngineConfig(group_policy="elastic"))
    with pytest.raises(ValueError, match="needs sequence_parallel_size > 1"):
        ParallelConfig.of(EngineConfig(group_policy="elastic", cfg_parallel_size=2))


def test_the_elastic_split_rule():
    assert [rows_split_pays(rows, 2) for rows in range(1, 7)] == [False, True, False, True, True, True]
    assert [rows_split_pays(rows, 4) for rows in (3, 4, 5, 6, 8, 9)] == [False, True, False, False, True, True]


@pytest.mark.slow
def test_an_elastic_group_gives_the_one_worker_images_and_reports_deadlines(flux_path):
    # 4 rows, then 3, 2, 1 as the requests finish: rows, tokens, rows, tokens
    params = [SamplingParams(num_inference_steps=n, seed=i, height=32, width=32, output_type="np",
                             deadline_s=deadline)
              for i, (n, deadline) in enumerate(zip([2, 3, 4, 5], [None, 3600.0, 1e-6, None]))]
    alone = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    try:
        want = [o.images[0] for o in alone.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        alone.shutdown()
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", sequence_parallel_size=2,
                             group_policy="elastic")
    try:
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        for out, image in zip(outs, want, strict=True):
            assert float(np.abs(out.images[0] - image).max()) <= TOL
        group = engine.executor.worker.group
        assert group.forwards == {"rows": 3, "tokens": 2, "alone": 0} and group.restarts == 0
        assert [o.metrics.deadline_met for o in outs] == [None, True, False, None]
        stats = engine.stats()
        assert (stats["deadlines_met"], stats["deadlines_missed"]) == (1, 1)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
