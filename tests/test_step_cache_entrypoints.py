"""Step caching through `dvllm serve` (the `cache` body field, --default-cache, 400s, Prometheus counters)
and `dvllm generate` (--cache, a JSONL line's "cache")."""
from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from utils_cli import expect_usage_error, restore_logging  # noqa: F401 (fixtures)
from utils_server import RemoteServer, assert_error, metrics, png_pixels

from dvllm import DiffusionEngine, SamplingParams
from dvllm.entrypoints.cli import main

FLUX_CACHE = {"method": "first_block", "threshold": 0.2}
CLI = ["--device", "cpu", "--dtype", "float32", "--no-progress", "--steps", "6", "--size", "32x32", "--seed", "3"]


def offline(path: str, cache, steps: list | None = None) -> np.ndarray:
    """The engine's image (8-bit) for the test's request; its cached_steps go to `steps`."""
    params = SamplingParams(num_inference_steps=6, height=32, width=32, seed=3, output_type="np", cache=cache)
    out = DiffusionEngine(model=path, device="cpu", dtype="float32").generate("a red circle", params, use_tqdm=False)
    if steps is not None:
        steps.append(out[0].metrics.cached_steps)
    return np.round(out[0].images[0] * 255)


@pytest.mark.slow
def test_served_cache_field_default_and_errors(flux_path):
    body = {"prompt": "a red circle", "size": "32x32", "seed": 3, "num_inference_steps": 6}
    with RemoteServer(flux_path, ["--device", "cpu", "--dtype", "float32", "--default-cache",
                                  "first_block:threshold=0.2"]) as server:
        url = server.url + "/v1/images/generations"
        default = httpx.post(url, json=body, timeout=120)
        opted_out = httpx.post(url, json={**body, "cache": None}, timeout=120)
        taylor = httpx.post(url, json={**body, "cache": {"method": "taylorseer", "cache_interval": 2}}, timeout=120)
        taylor_cache = {"method": "taylorseer", "cache_interval": 2}
        streamed = httpx.post(url, json={**body, "stream": True, "cache": taylor_cache}, timeout=120)
        bad_method = httpx.post(url, json={**body, "cache": {"method": "fastercache"}}, timeout=30)
        bad_field = httpx.post(url, json={**body, "cache": {"method": "first_block", "treshold": 1}}, timeout=30)
        not_object = httpx.post(url, json={**body, "cache": "first_block"}, timeout=30)
        counters = metrics(server.url)
    for response in (default, opted_out, taylor):
        assert response.status_code == 200, response.text
    assert "cached_steps" not in opted_out.json()  # no cache, no count
    assert taylor.json()["cached_steps"] == 2  # steps 0-2 computed, then every other one: 3 and 5 predicted
    completed = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                 if line.startswith("data: ") and '"image_generation.completed"' in line]
    assert len(completed) == 1 and completed[0]["cached_steps"] == 2
    assert_error(bad_method, 400, "cache")
    assert "teacache" in bad_field.text or "treshold" in bad_field.text
    assert_error(bad_field, 400, "cache")
    assert_error(not_object, 400, "cache")
    pixels = {name: png_pixels(r.json()["data"][0]["b64_json"]).astype(np.float64)
              for name, r in (("default", default), ("none", opted_out))}
    steps = []
    assert np.abs(pixels["default"] - offline(flux_path, FLUX_CACHE, steps)).max() <= 1
    assert default.json()["cached_steps"] == steps[0]
    assert np.abs(pixels["none"] - offline(flux_path, None)).max() <= 1
    assert counters["dvllm_step_cache_skipped_rows_total"] > 0
    assert counters["dvllm_step_cache_computed_rows_total"] > 0


@pytest.mark.slow
def test_unet_server_refuses_cache_with_a_400(sd_eps_path):
    body = {"prompt": "x", "size": "16x16", "num_inference_steps": 2, "cache": {"method": "first_block"}}
    png = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(png, format="PNG")
    form = {"prompt": "x", "num_inference_steps": "2"}
    with RemoteServer(sd_eps_path, ["--device", "cpu", "--dtype", "float32"]) as server:
        response = httpx.post(server.url + "/v1/images/generations", json=body, timeout=60)
        edit = httpx.post(server.url + "/v1/images/edits", data={**form, "cache": '{"method": "first_block"}'},
                          files={"image": ("in.png", png.getvalue(), "image/png")}, timeout=60)
        not_json = httpx.post(server.url + "/v1/images/edits", data={**form, "cache": "{method"},
                              files={"image": ("in.png", png.getvalue(), "image/png")}, timeout=60)
        opted_out = httpx.post(server.url + "/v1/images/edits", data={**form, "cache": "null"},
                               files={"image": ("in.png", png.getvalue(), "image/png")}, timeout=60)
    for refused in (response, edit):
        error = assert_error(refused, 400, "cache")
        assert "stable-diffusion family serves no step caching" in error["message"]
    assert "expected a JSON object or null" in assert_error(not_json, 400, "cache")["message"]
    assert opted_out.status_code == 200, opted_out.text  # a form's JSON null: no cache, as in a JSON body


@pytest.mark.slow
def test_generate_cache_flag_and_jsonl_cache(flux_path, tmp_path):
    flag = tmp_path / "flag.png"
    assert main(["generate", "a red circle", "-o", str(flag), "--model", flux_path, *CLI,
                 "--cache", "first_block:threshold=0.2"]) == 0
    with Image.open(flag) as image:
        assert np.abs(np.asarray(image.convert("RGB")) - offline(flux_path, FLUX_CACHE)).max() <= 1
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"prompt": "a red circle", "cache": None, "output": "none.png"}) + "\n")
    assert main(["generate", "--prompts-file", str(lines), "--output-dir", str(tmp_path), "--model", flux_path,
                 *CLI, "--cache", "first_block:threshold=0.2"]) == 0  # the line's null beats the flag
    with Image.open(tmp_path / "none.png") as image:
        assert np.abs(np.asarray(image.convert("RGB")) - offline(flux_path, None)).max() <= 1


@pytest.mark.parametrize("flag, expected", [("fastercache", "--cache: cache.method"),
                                            ("first_block:threshold", "--cache: cache: expected name=value")])
def test_generate_bad_cache_flag_is_a_usage_error(flux_path, capsys, flag, expected):
    err = expect_usage_error(capsys, "generate", "x", "--model", flux_path, *CLI, "--cache", flag)
    assert expected in err
