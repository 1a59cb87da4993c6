"""Every model family through the real `dvllm serve`: the served image is the offline engine's."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams
from utils_server import RemoteServer

FAMILIES = ["sdxl_path", "sd3_path", "flux_path", "qwen_image_path", "z_image_path"]


@pytest.mark.parametrize("fixture", FAMILIES)
@pytest.mark.slow
def test_family_serves_the_offline_image(fixture, request):
    path = request.getfixturevalue(fixture)
    body = {"prompt": "a red circle", "size": "32x32", "seed": 5, "num_inference_steps": 3, "guidance_scale": 4.0,
            "negative_prompt": "dull"}
    with RemoteServer(path, ["--device", "cpu", "--dtype", "float32"]) as server:
        response = httpx.post(server.url + "/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()["data"][0]
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(data["b64_json"]))).convert("RGB"))
    assert data["seed"] == 5 and served.shape == (32, 32, 3)
    params = SamplingParams(num_inference_steps=3, guidance_scale=4.0, negative_prompt="dull", seed=5, height=32,
                            width=32, output_type="np")
    offline = DiffusionEngine(model=path, device="cpu", dtype="float32").generate("a red circle", params,
                                                                                 use_tqdm=False)[0]
    expected = np.round(offline.images[0] * 255)
    diff = np.abs(served.astype(np.float64) - expected)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99  # 8-bit PNG: a value on a rounding edge may flip
