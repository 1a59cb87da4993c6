"""POST /v1/images/edits on the real server: OpenAI's multipart form, served as image-to-image."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams
from utils_server import RemoteServer


def png_bytes(seed: int, size: tuple[int, int] = (32, 24)) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="module")
def server(sd_eps_path):
    with RemoteServer(sd_eps_path, ["--device", "cpu", "--dtype", "float32"]) as s:
        yield s


@pytest.mark.slow
def test_openai_client_edit_equals_the_offline_engine(server, sd_eps_path):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    result = client.images.edit(image=("start.png", png_bytes(1), "image/png"), prompt="a red circle",
                                extra_body={"seed": 7, "strength": 0.6, "num_inference_steps": 8,
                                            "guidance_scale": 5.0})
    served = decode(result.data[0].b64_json)
    offline = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").generate(
        "a red circle", SamplingParams(image=Image.open(io.BytesIO(png_bytes(1))), strength=0.6, num_inference_steps=8,
                                       guidance_scale=5.0, seed=7, output_type="np"), use_tqdm=False)[0]
    expected = np.round(offline.images[0] * 255)
    assert served.shape == (24, 32, 3)
    diff = np.abs(served.astype(np.float64) - expected)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99


@pytest.mark.slow
def test_edit_streams_image_edit_events(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    events = list(client.images.edit(image=("start.png", png_bytes(2), "image/png"), prompt="a star", stream=True,
                                     partial_images=2, extra_body={"seed": 1, "strength": 0.9,
                                                                   "num_inference_steps": 9}))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]


@pytest.mark.parametrize("files, data, status, param", [
    ({}, {"prompt": "x"}, 400, "image"),
    ({"image": ("a.txt", b"not an image", "text/plain")}, {"prompt": "x"}, 400, "image"),
    ({"image": ("a.png", png_bytes(1), "image/png"), "mask": ("m.png", png_bytes(2, (16, 16)), "image/png")},
     {"prompt": "x"}, 400, "mask"),  # a mask must have the image's size (masks: test_edit_entrypoints.py)
    ({"image": ("a.png", png_bytes(1), "image/png")}, {"prompt": "x", "strength": "1.5"}, 400, "strength"),
    ({"image": ("a.png", png_bytes(1), "image/png")}, {"prompt": "x", "seed": "seven"}, 400, "seed"),
    ({"image": ("a.png", png_bytes(1), "image/png")}, {}, 400, "prompt"),
    ({"image": ("a.png", png_bytes(1, (4, 4)), "image/png")}, {"prompt": "x"}, 400, "image"),
])
@pytest.mark.slow
def test_bad_edits_are_4xx_naming_the_field(server, files, data, status, param):
    response = httpx.post(server.url + "/v1/images/edits", files=files or None, data=data, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_edits_want_a_multipart_form(server):
    response = httpx.post(server.url + "/v1/images/edits", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 415
