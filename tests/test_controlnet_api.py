"""ControlNet through `dvllm serve` (a real server in a subprocess, `--controlnet NAME=PATH`) and `dvllm generate`
(a prompts file's "controls" with image paths): each gives the Python API's images, and bad controls are a 400
(or a usage error) naming the field."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from test_controlnet import control_image, tiny_controlnet
from utils_cli import FAST, write_lines
from utils_server import BASE_ARGS, RemoteServer, assert_error, png_pixels

from dvllm import DiffusionEngine, SamplingParams
from dvllm.entrypoints.cli import main


@pytest.fixture(scope="module")
def edges(sd_eps_path, tmp_path_factory) -> str:
    from diffusers import UNet2DConditionModel

    folder = tmp_path_factory.mktemp("controlnet-edges")
    tiny_controlnet(UNet2DConditionModel.from_pretrained(sd_eps_path, subfolder="unet"), 10).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def server(sd_eps_path, edges):
    with RemoteServer(sd_eps_path, [*BASE_ARGS, "--controlnet", f"edges={edges}"]) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def b64_png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def offline(sd_eps_path: str, edges: str, requests: list[tuple[str, SamplingParams]]) -> list:
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets={"edges": edges})
    try:
        return engine.generate([q for q, _ in requests], [p for _, p in requests], use_tqdm=False)
    finally:
        engine.shutdown()


def assert_same_pixels(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got.astype(np.int16) - np.round(want * 255).astype(np.int16))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, diff.max()  # a value on a rounding edge may flip


def test_generations_with_controls_equal_the_python_api(http, sd_eps_path, edges):
    image = control_image(1)
    body = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 4, "size": "16x16", "guidance_scale": 5.0,
            "controls": [{"name": "edges", "image": b64_png(image), "scale": 0.7, "start": 0.25}]}
    r = http.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    data_url = dict(body, controls=[dict(body["controls"][0], image="data:image/png;base64," + b64_png(image))])
    r2 = http.post("/v1/images/generations", json=data_url)
    assert r2.status_code == 200, r2.text
    want = offline(sd_eps_path, edges, [("a red circle", SamplingParams(
        num_inference_steps=4, seed=3, height=16, width=16, guidance_scale=5.0, output_type="np",
        controls=[{"name": "edges", "image": image, "scale": 0.7, "start": 0.25}]))])[0]
    for response in (r, r2):
        assert_same_pixels(png_pixels(response.json()["data"][0]["b64_json"]), want.images[0])


def test_models_lists_the_controlnets(http):
    facts = http.get("/v1/models").json()["data"][0]["dvllm"]
    assert facts["controlnets"] == ["edges"]
    assert "control_modes" not in facts  # (a union controlnet's count of modes only: test_controlnet_union.py)


@pytest.mark.parametrize("controls, param", [
    ([{"name": "nope", "image": "IMAGE"}], "controls[0].name"),
    ([{"name": "edges", "image": "not base64!"}], "controls[0].image"),
    ([{"name": "edges", "image": "IMAGE", "scale": -1}], "controls[0].scale"),
    ([{"name": "edges", "image": "IMAGE", "mode": 1}], "controls[0].mode"),  # not a union controlnet
    ([{"name": "edges", "image": "IMAGE", "start": 0.9, "end": 0.1}], "controls[0]"),
    ([{"name": "edges", "image": "IMAGE"}] * 5, "controls"),
    (["edges"], "controls[0]"),
    ([{"name": "edges", "image": "BIG"}], "controls[0].image"),  # past --max-image-pixels 4096
])
def test_bad_controls_are_a_400_naming_the_field(http, controls, param):
    images = {"IMAGE": b64_png(control_image(2)), "BIG": b64_png(control_image(2, (80, 80)))}
    controls = [{**c, "image": images.get(c["image"], c["image"])} if isinstance(c, dict) else c for c in controls]
    r = http.post("/v1/images/generations", json={"prompt": "a cat", "size": "16x16", "controls": controls})
    assert_error(r, 400, param)


def test_generate_reads_controls_from_a_prompts_file(sd_eps_path, edges, tmp_path):
    control_image(4).save(tmp_path / "edges.png")
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        {"prompt": "a blue square", "seed": 5, "controls": [{"name": "edges", "image": "edges.png", "scale": 0.5}]},
    ])
    out = tmp_path / "out"
    assert main(["generate", "--model", sd_eps_path, *FAST, "--prompts-file", str(prompts), "--output-dir", str(out),
                 "--controlnet", f"edges={edges}"]) == 0
    (png,) = sorted(out.glob("*.png"))
    steps = int(FAST[FAST.index("--steps") + 1]) if "--steps" in FAST else None
    size = FAST[FAST.index("--size") + 1] if "--size" in FAST else None
    width, height = (int(x) for x in size.split("x"))
    want = offline(sd_eps_path, edges, [("a blue square", SamplingParams(
        num_inference_steps=steps, seed=5, height=height, width=width, output_type="np",
        controls=[{"name": "edges", "image": control_image(4), "scale": 0.5}]))])[0]
    with Image.open(png) as image:
        assert_same_pixels(np.asarray(image.convert("RGB")), want.images[0])
        assert json.loads(image.text["parameters"])["controls"] == [
            {"name": "edges", "image": str(tmp_path / "edges.png"), "scale": 0.5, "start": 0.0, "end": 1.0}]


def png_bytes(image: Image.Image) -> bytes:
    return base64.b64decode(b64_png(image))


def test_edits_take_controls_as_json_with_control_image_files(http, sd_eps_path, edges):
    """Image-to-image with controls over the edits form: `controls` as JSON text, a control without an image takes
    the next `control_image[]` file, another carries its own base64; the Python API's pixels."""
    from test_inpaint import picture

    start, first, second = picture(4), control_image(5), control_image(6)
    controls = [{"name": "edges", "scale": 0.8}, {"name": "edges", "image": b64_png(second), "start": 0.5}]
    data = {"prompt": "a boat", "seed": 7, "num_inference_steps": 5, "guidance_scale": 4.0, "strength": 0.8,
            "controls": json.dumps(controls)}
    files = [("image", ("start.png", png_bytes(start), "image/png")),
             ("control_image[]", ("edges.png", png_bytes(first), "image/png"))]
    r = http.post("/v1/images/edits", data=data, files=files)
    assert r.status_code == 200, r.text
    want = offline(sd_eps_path, edges, [("a boat", SamplingParams(
        num_inference_steps=5, seed=7, guidance_scale=4.0, strength=0.8, image=start, output_type="np",
        controls=[{"name": "edges", "image": first, "scale": 0.8}, {"name": "edges", "image": second, "start": 0.5}]))])
    assert want[0].error is None, want[0].error
    assert_same_pixels(png_pixels(r.json()["data"][0]["b64_json"]), want[0].images[0])
    extra = files + [("control_image[]", ("more.png", png_bytes(second), "image/png"))]
    bad = http.post("/v1/images/edits", data=data, files=extra)
    assert_error(bad, 400, "control_image")
    bad = http.post("/v1/images/edits", data=dict(data, controls="[{"), files=files)
    assert_error(bad, 400, "controls")
