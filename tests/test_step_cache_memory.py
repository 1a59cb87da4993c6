"""A caching step holds one copy of each caching row's state: a computing group's new state is written over the
copy it gathered from the pool (not into a second buffer), and the pool is written only at commit."""
from __future__ import annotations

import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker import denoise_batch

MAG = {"method": "mag", "mag_ratios": [1.0] * 4, "num_inference_steps": 4, "threshold": 0.5}


@pytest.mark.parametrize("cache", [{"method": "first_block", "threshold": 0.5}, {"method": "taylorseer"}, MAG],
                         ids=lambda c: c["method"])
def test_computing_groups_write_over_their_gathered_state(cache, flux_path, monkeypatch):
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
    computing = [g for f in forwards for g in f.groups if g.computes]
    assert computing
    for g in computing:  # the same storage: no second state-sized buffer per row
        assert g.new.untyped_storage().data_ptr() == g.data.untyped_storage().data_ptr()
