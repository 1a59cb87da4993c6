"""`dvllm serve --model tiny-shapes-dit` works offline like the default: the second built-in model ships in
the package, loads by name with no network (the Hub is switched off), and serves what the engine makes."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
from utils_server import BASE_ARGS, WAIT, RemoteServer, png_pixels

from dvllm import DiffusionEngine, SamplingParams

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.slow
def test_serve_tiny_shapes_dit_offline_equals_the_engine():
    with RemoteServer("tiny-shapes-dit", BASE_ARGS, env=OFFLINE) as s:
        models = httpx.get(s.url + "/v1/models", timeout=WAIT).json()["data"]
        assert [m["id"] for m in models] == ["tiny-shapes-dit"]
        # no size or steps: the model's own defaults (64x64, its step count) from its dvllm_defaults.json
        r = httpx.post(s.url + "/v1/images/generations", json={"prompt": "a large red circle on the left", "seed": 7},
                       timeout=WAIT)
        assert r.status_code == 200, r.text
        served = png_pixels(r.json()["data"][0]["b64_json"]).astype(np.int16)
    engine = DiffusionEngine(model="tiny-shapes-dit", device="cpu", dtype="float32")
    want = engine.generate("a large red circle on the left", SamplingParams(seed=7, output_type="np"),
                           use_tqdm=False)[0].images[0]
    assert served.shape == (64, 64, 3)
    diff = np.abs(served - np.round(want * 255).astype(np.int16))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (diff.max(), (diff != 0).sum())
