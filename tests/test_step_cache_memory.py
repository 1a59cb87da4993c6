"""A caching step holds no copy of a caching row's state: the scheduler gives a request's step-cache state one run
of blocks, and the worker reads and updates it in place, through a view of the pool. A forward that fails after
writing part of a state leaves it marked, and the request's next step starts its cache afresh."""
from __future__ import annotations

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker import denoise_batch

MAG = {"method": "mag", "mag_ratios": [1.0] * 4, "num_inference_steps": 4, "threshold": 0.5}


@pytest.mark.parametrize("cache", [{"method": "first_block", "threshold": 0.5}, {"method": "taylorseer"}, MAG],
                         ids=lambda c: c["method"])
def test_caching_rows_update_their_state_in_place_in_the_pool(cache, flux_path, monkeypatch):
    forwards = []
    real = denoise_batch.forward_cache

    def recording(*args, **kwargs):
        forwards.append(real(*args, **kwargs))
        return forwards[-1]

    monkeypatch.setattr(denoise_batch, "forward_cache", recording)
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    params = [SamplingParams(num_inference_steps=4, height=32, width=32, seed=s, guidance_scale=g, cache=cache)
              for s, g in ((1, 3.5), (2, 1.0))]
    outs = engine.generate(["a", "b"], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    pool = engine.executor.worker.pool.data.untyped_storage().data_ptr()
    groups = [g for f in forwards for g in f.groups]
    assert groups and all(g.in_place for g in groups)
    for g in groups:  # the pool's own storage: no state-sized copy per row
        assert g.data.untyped_storage().data_ptr() == pool
    computing = [g for g in groups if g.computes]
    assert computing and all(g.new.untyped_storage().data_ptr() == pool for g in computing)


@pytest.mark.parametrize("cache", [{"method": "first_block", "threshold": 0.5}, {"method": "taylorseer"}, MAG],
                         ids=lambda c: c["method"])
def test_a_forward_failing_after_a_state_write_restarts_that_cache(cache, flux_path, caplog):
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    runner = engine.executor.worker.runner
    adapter = runner.adapter
    written_at_failure = []

    def failing_once_after_the_forward(*args, **kwargs):  # the cache hooks have written by then
        out = type(adapter).denoise(adapter, *args, **kwargs)
        written = [s.request_id for s in runner.states.values() if s.cache is not None and s.cache.written]
        if len(args[0]) == 2 and not written_at_failure:  # the two requests' batch, not a rerun alone
            written_at_failure.extend(written)
            raise RuntimeError("out of memory (injected)")
        return out

    adapter.denoise = failing_once_after_the_forward
    params = [SamplingParams(num_inference_steps=4, height=32, width=32, seed=s, guidance_scale=g, cache=cache,
                             output_type="np") for s, g in ((1, 3.5), (2, 1.0))]
    with caplog.at_level("WARNING"):
        outs = engine.generate(["a", "b"], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]  # each request ran its failed step again, alone
    assert len(written_at_failure) == 2  # the first step computes: both wrote into the pool before the failure
    restarted = [r.getMessage() for r in caplog.records if "half written by a failed step" in r.getMessage()]
    assert len(restarted) == 2 and all(any(i in m for m in restarted) for i in written_at_failure)
    assert all(np.isfinite(o.images[0]).all() for o in outs)
    assert not any(s.cache.written for s in runner.states.values() if s.cache is not None)
