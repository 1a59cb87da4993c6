"""IP-Adapter image prompts through `dvllm serve` (a real server in a subprocess, `--ip-adapter WEIGHTS`, its core
in a process of its own, with async scheduling and the encode and decode stages: the image travels with the
request) and `dvllm generate` (a prompts file's "ip_adapter_image" path): each gives the Python API's images, and
bad image prompts are a 400 naming the field."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from PIL import Image
from test_controlnet_api import assert_same_pixels, b64_png
from test_ip_adapter import image_prompt, tiny_image_encoder, tiny_unet_ip_adapter
from utils_cli import FAST, write_lines
from utils_server import BASE_ARGS, RemoteServer, assert_error, png_pixels

from dvllm import DiffusionEngine, SamplingParams
from dvllm.entrypoints.cli import main


@pytest.fixture(scope="module")
def weights(sd_eps_path, tmp_path_factory) -> str:
    from diffusers import UNet2DConditionModel

    folder = tmp_path_factory.mktemp("ip-adapter")
    tiny_image_encoder(folder / "image_encoder")
    tiny_unet_ip_adapter(UNet2DConditionModel.from_pretrained(sd_eps_path, subfolder="unet"),
                         folder / "ip-adapter.safetensors")
    return str(folder / "ip-adapter.safetensors")


@pytest.fixture(scope="module")
def offline(sd_eps_path, weights):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", ip_adapter=weights)
    yield lambda prompt, params: engine.generate(prompt, params, use_tqdm=False)[0]
    engine.shutdown()


@pytest.fixture(scope="module")
def http(sd_eps_path, weights):
    flags = ["--ip-adapter", weights, "--async-scheduling", "--encode-stage", "--decode-stage"]
    with RemoteServer(sd_eps_path, [*BASE_ARGS, *flags]) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


def test_models_says_the_server_takes_image_prompts(http):
    assert http.get("/v1/models").json()["data"][0]["dvllm"]["ip_adapter"] is True


def test_generations_with_an_image_prompt_equal_the_python_api(http, offline):
    image = image_prompt(1)
    body = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 3, "size": "16x16", "guidance_scale": 5.0,
            "ip_adapter_image": b64_png(image), "ip_adapter_scale": 0.6}
    r = http.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    r2 = http.post("/v1/images/generations", json=dict(body, ip_adapter_image="data:image/png;base64," + b64_png(image)))
    assert r2.status_code == 200, r2.text
    want = offline("a red circle", SamplingParams(num_inference_steps=3, seed=3, height=16, width=16,
                                                  guidance_scale=5.0, output_type="np", ip_adapter_image=image,
                                                  ip_adapter_scale=0.6))
    for response in (r, r2):
        assert_same_pixels(png_pixels(response.json()["data"][0]["b64_json"]), want.images[0])


@pytest.mark.parametrize("fields, param", [
    ({"ip_adapter_image": "not base64!"}, "ip_adapter_image"),
    ({"ip_adapter_image": 3}, "ip_adapter_image"),
    ({"ip_adapter_image": "BIG"}, "ip_adapter_image"),  # past --max-image-pixels 4096
    ({"ip_adapter_image": "IMAGE", "ip_adapter_scale": -1}, "ip_adapter_scale"),
    ({"ip_adapter_image": "IMAGE", "ip_adapter_scale": "x"}, "ip_adapter_scale"),
])
def test_bad_image_prompts_are_a_400_naming_the_field(http, fields, param):
    images = {"IMAGE": b64_png(image_prompt(2)), "BIG": b64_png(image_prompt(2, (80, 80)))}
    fields = {k: images.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    assert_error(http.post("/v1/images/generations", json={"prompt": "a cat", "size": "16x16", **fields}), 400, param)


def test_generate_reads_image_prompts_from_a_prompts_file(sd_eps_path, weights, offline, tmp_path):
    image_prompt(4).save(tmp_path / "style.png")
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        {"prompt": "a blue square", "seed": 5, "ip_adapter_image": "style.png", "ip_adapter_scale": 0.5}])
    out = tmp_path / "out"
    assert main(["generate", "--model", sd_eps_path, *FAST, "--prompts-file", str(prompts), "--output-dir", str(out),
                 "--ip-adapter", weights]) == 0
    (png,) = sorted(out.glob("*.png"))
    steps = int(FAST[FAST.index("--steps") + 1]) if "--steps" in FAST else None
    width, height = (int(x) for x in FAST[FAST.index("--size") + 1].split("x"))
    want = offline("a blue square", SamplingParams(num_inference_steps=steps, seed=5, height=height, width=width,
                                                   output_type="np", ip_adapter_image=image_prompt(4),
                                                   ip_adapter_scale=0.5))
    with Image.open(png) as saved:
        assert_same_pixels(np.asarray(saved.convert("RGB")), want.images[0])
        parameters = json.loads(saved.text["parameters"])
    assert parameters["ip_adapter_image"] == str(tmp_path / "style.png") and parameters["ip_adapter_scale"] == 0.5
