"""LoRA adapters through `dvllm serve` (the `loras` field, `model` naming an adapter, /v1/models, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, edits' form field) and `dvllm generate` (--lora, a JSONL
line's "loras"). Each served or generated image equals the in-process engine's for the same request."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from lora_utils import make_lora
from openai import OpenAI
from PIL import Image
from utils_cli import expect_usage_error, no_model_load, restore_logging  # noqa: F401 (fixtures)
from utils_server import BASE_ARGS, RemoteServer, assert_error, assert_pixels_of, png_pixels

from dvllm import DiffusionEngine, SamplingParams
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.entrypoints.cli import main

LORA_ARGS = ["--max-loras", "2", "--max-lora-rank", "8"]  # the reference engine's too
REQUEST = {"num_inference_steps": 4, "seed": 3}  # at 16x16: the size BASE_ARGS' pixel limit allows
CLI = ["--device", "cpu", "--dtype", "float32", "--no-progress", "--steps", "4", "--size", "16x16", "--seed", "3"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Two adapters for the tiny SD of `sd_eps_path`: "style" changes the UNet, "product" (loaded at run time)
    the UNet and the text encoder."""
    from conftest import tiny_sd_pipeline

    folder, pipe = tmp_path_factory.mktemp("lora-entrypoints"), tiny_sd_pipeline()
    return {"style": make_lora(pipe, str(folder / "style"), seed=1),
            "product": make_lora(pipe, str(folder / "product"), seed=2, components=("unet", "text_encoder"))}


@pytest.fixture(scope="module")
def reference(sd_eps_path, adapters):
    """The in-process engine's image (float, [0, 1]) for a request: what every entrypoint must give, rounded
    (assert_pixels_of)."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules=adapters, max_loras=2,
                             max_lora_rank=8)

    def image(prompt: str = "a red circle", loras: dict | None = None, **params) -> np.ndarray:
        p = SamplingParams(**{"height": 16, "width": 16, **REQUEST, **params}, loras=loras, output_type="np")
        return engine.generate(prompt, p, use_tqdm=False)[0].images[0]

    yield image
    engine.shutdown()


@pytest.fixture(scope="module")
def server(sd_eps_path, adapters):
    with RemoteServer(sd_eps_path, [*BASE_ARGS, *LORA_ARGS, "--lora-modules", f"style={adapters['style']}",
                                    "--allow-runtime-lora-updating"]) as s:
        yield s


def generate(server: RemoteServer, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/images/generations",
                      json={"prompt": "a red circle", "size": "16x16", **REQUEST, **body}, timeout=120)


def pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return png_pixels(response.json()["data"][0]["b64_json"])


def base_model(server: RemoteServer) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


# -- dvllm serve ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_openai_client_loras_equal_the_engine(server, reference):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    served = client.images.generate(prompt="a red circle", size="16x16", response_format="b64_json",
                                    extra_body={**REQUEST, "loras": {"style": 0.8}})
    with_lora = png_pixels(served.data[0].b64_json)
    assert_pixels_of(with_lora, reference(loras={"style": 0.8}))
    without = pixels(generate(server))
    assert_pixels_of(without, reference())
    assert np.abs(with_lora.astype(int) - without).max() > 8  # the adapter changes the image


@pytest.mark.slow
def test_model_naming_an_adapter_uses_it_at_weight_one(server, reference):
    by_model = pixels(generate(server, model="style"))
    np.testing.assert_array_equal(by_model, pixels(generate(server, loras={"style": 1.0})))
    assert_pixels_of(by_model, reference(loras={"style": 1.0}))
    # an explicit weight for the same adapter wins; the base model's name means no adapter
    assert_pixels_of(pixels(generate(server, model="style", loras={"style": 0.3})),
                                  reference(loras={"style": 0.3}))
    assert_pixels_of(pixels(generate(server, model=base_model(server))), reference())


@pytest.mark.slow
@pytest.mark.parametrize("fields, status, param, words", [  # JSON text: httpx cannot send 1e400
    ('"loras": {"nope": 1.0}', 400, "loras", "'nope'"),
    ('"loras": {"style": "high"}', 400, "loras", "weight of 'style'"),
    ('"loras": {"style": true}', 400, "loras", "weight of 'style'"),
    ('"loras": {"style": 1e400}', 400, "loras", "[-100, 100]"),  # Python's JSON reads it as infinity
    ('"loras": {"style": ' + "9" * 400 + '}', 400, "loras", "[-100, 100]"),  # too large for a float
    ('"loras": ["style"]', 400, "loras", "loras"),
    ('"loras": {"style": 1.0, "a": 1.0, "b": 1.0}', 400, "loras", "max_loras is 2"),
    ('"model": "nope"', 404, "model", "'nope'"),
], ids=["unknown", "string-weight", "bool-weight", "infinite-weight", "huge-integer", "not-an-object", "too-many",
        "unknown-model"])
def test_bad_loras_are_400s_naming_the_field(server, fields, status, param, words):
    body = '{"prompt": "a red circle", "size": "16x16", "num_inference_steps": 4, ' + fields + "}"
    response = httpx.post(server.url + "/v1/images/generations", content=body,
                          headers={"content-type": "application/json"}, timeout=120)
    error = assert_error(response, status, param)
    assert words in error["message"], error


@pytest.mark.slow
def test_models_lists_each_adapter_with_its_parent(server, adapters):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    base = models[0]["id"]
    assert set(models[0]) == {"id", "object", "created", "owned_by", "dvllm"}  # the base model's, with its facts
    card = {"id": "style", "object": "model", "owned_by": "dvllm", "parent": base}
    assert [{k: m[k] for k in card} for m in models[1:]] == [card]
    assert "root" not in models[1]  # the server's paths are not shown without --show-lora-paths
    assert httpx.get(server.url + "/v1/models/style", timeout=30).json()["parent"] == base
    assert OpenAI(base_url=server.url + "/v1", api_key="unused").models.retrieve("style").id == "style"


@pytest.mark.slow
def test_runtime_load_generate_unload(server, adapters, reference):
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    loaded = httpx.post(load, json={"lora_name": "product", "lora_path": adapters["product"]}, timeout=120)
    assert loaded.status_code == 200 and "product" in loaded.text
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"][1:]] == \
            ["style", "product"]
        assert_pixels_of(pixels(generate(server, loras={"product": 0.7, "style": 0.5})),
                                      reference(loras={"product": 0.7, "style": 0.5}))
        assert_pixels_of(pixels(generate(server, model="product")), reference(loras={"product": 1.0}))
        again = httpx.post(load, json={"lora_name": "product", "lora_path": adapters["product"]}, timeout=30)
        assert "already loaded" in assert_error(again, 400, "lora_name")["message"]
    finally:
        removed = httpx.post(unload, json={"lora_name": "product"}, timeout=30)
    assert removed.status_code == 200 and "product" in removed.text
    assert "'product'" in assert_error(generate(server, loras={"product": 1.0}), 400, "loras")["message"]
    assert_error(generate(server, model="product"), 404, "model")
    assert_error(httpx.post(unload, json={"lora_name": "product"}, timeout=30), 400, "lora_name")
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"][1:]] == ["style"]


@pytest.mark.slow
@pytest.mark.parametrize("body, param, words", [
    # a missing path and a folder without weights are answered alike (the log tells them apart)
    ({"lora_name": "x", "lora_path": "/nonexistent/lora"}, "lora_path", "is not a loadable adapter"),
    ({"lora_name": "x", "lora_path": "MODEL"}, "lora_path", "is not a loadable adapter"),  # the model folder
    ({"lora_name": "bad name", "lora_path": "STYLE"}, "lora_name", "LoRA name"),
    ({"lora_name": "BASE", "lora_path": "STYLE"}, "lora_name", "served model's name"),
    ({"lora_name": "x"}, "lora_path", "Missing required parameter"),
    ({"lora_name": 1, "lora_path": "STYLE"}, "lora_name", "Invalid value"),
], ids=["missing-path", "not-a-lora", "bad-name", "base-name", "no-path", "not-a-string"])
def test_bad_loads_are_400s(server, sd_eps_path, adapters, body, param, words):
    paths = {"MODEL": sd_eps_path, "STYLE": adapters["style"]}
    body = {k: paths.get(v, base_model(server) if v == "BASE" else v) for k, v in body.items()}
    error = assert_error(httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120), 400, param)
    assert words in error["message"], error
    assert len(httpx.get(server.url + "/v1/models", timeout=30).json()["data"]) == 2  # nothing was loaded


def png_bytes(color: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.slow
def test_edits_take_loras_as_a_json_form_field(server, reference):
    form = {"prompt": "a red circle", "seed": "3", "num_inference_steps": "4", "strength": "0.75"}

    def edit(**fields) -> httpx.Response:
        return httpx.post(server.url + "/v1/images/edits", data={**form, **fields},
                          files={"image": ("in.png", png_bytes(), "image/png")}, timeout=120)

    start = Image.open(io.BytesIO(png_bytes()))
    with_lora = pixels(edit(loras='{"style": 0.8}'))
    assert_pixels_of(with_lora, reference(loras={"style": 0.8}, image=start, strength=0.75))
    assert_pixels_of(pixels(edit(model="style")), reference(loras={"style": 1.0}, image=start,
                                                                         strength=0.75))
    assert not np.array_equal(with_lora, pixels(edit()))
    assert "expected a JSON object" in assert_error(edit(loras="{style"), 400, "loras")["message"]
    assert "'nope'" in assert_error(edit(loras='{"nope": 1}'), 400, "loras")["message"]


# -- build_app in-process: the route flag, LoRA off, loading off the event loop -----------------------------

@pytest.fixture(scope="module")
def plain_engine(sd_eps_path):
    """An engine without LoRA."""
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32)
    yield engine
    asyncio.run(engine.shutdown(0))


def test_update_routes_are_404_without_the_flag(plain_engine):
    client = TestClient(build_app(plain_engine, argparse.Namespace()))  # no lifespan: no engine needed
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert_error(client.post(route, json={"lora_name": "x", "lora_path": "/tmp"}), 404)


def test_without_lora_loads_and_loras_are_400s(plain_engine, adapters):
    app = build_app(plain_engine, argparse.Namespace(allow_runtime_lora_updating=True))
    with TestClient(app) as client:
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["style"]})
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        refused = client.post("/v1/images/generations", json={"prompt": "x", "size": "16x16", "loras": {"x": 1}})
        models = client.get("/v1/models").json()["data"]
    for response in (loaded, unloaded):
        assert "--enable-lora" in assert_error(response, 400)["message"]
    assert "serves no LoRA adapters" in assert_error(refused, 400, "loras")["message"]
    assert len(models) == 1


def test_loading_runs_off_the_event_loop(sd_eps_path, adapters, monkeypatch):
    """While an adapter is being read, the server answers other requests and generates images."""
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32,
                                  enable_lora=True)
    reading, release = threading.Event(), threading.Event()
    real_load = engine.loras.load  # the async engine reads adapters where it checks requests

    def slow_load(name: str, path: str) -> None:
        reading.set()
        assert release.wait(60), "the test never released the load"
        real_load(name, path)

    monkeypatch.setattr(engine.loras, "load", slow_load)
    body = {"lora_name": "style", "lora_path": adapters["style"]}
    with TestClient(build_app(engine, argparse.Namespace(allow_runtime_lora_updating=True))) as client, \
            ThreadPoolExecutor(2) as pool:
        pending = pool.submit(client.post, "/v1/load_lora_adapter", json=body)
        try:
            assert reading.wait(60)
            # bounded waits: with the load on the event loop these would hang until it is released
            assert pool.submit(client.get, "/health").result(30).status_code == 200
            image = pool.submit(client.post, "/v1/images/generations",
                                json={"prompt": "x", "size": "16x16", **REQUEST}).result(60)
            assert image.status_code == 200, image.text
        finally:
            release.set()
        assert pending.result(60).status_code == 200
        assert [m["id"] for m in client.get("/v1/models").json()["data"][1:]] == ["style"]


# -- dvllm generate ------------------------------------------------------------------------------------

def _cli_image(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.mark.slow
def test_generate_lora_flag_and_jsonl_loras(sd_eps_path, adapters, reference, tmp_path):
    modules = ["--lora-modules", f"style={adapters['style']}", f"product={adapters['product']}", *LORA_ARGS]
    one = tmp_path / "one.png"
    assert main(["generate", "a red circle", "-o", str(one), "--model", sd_eps_path, *CLI, *modules,
                 "--lora", "style=0.5"]) == 0
    assert_pixels_of(_cli_image(one), reference(loras={"style": 0.5}))
    lines = tmp_path / "p.jsonl"
    lines.write_text("\n".join([
        json.dumps({"prompt": "a red circle", "loras": {"product": 0.7, "style": 1.0}, "output": "both.png"}),
        json.dumps({"prompt": "a red circle", "loras": None, "output": "none.png"}),  # null: no adapter at all
        json.dumps({"prompt": "a red circle", "output": "flags.png"}),
    ]) + "\n")
    assert main(["generate", "--prompts-file", str(lines), "--output-dir", str(tmp_path), "--model", sd_eps_path,
                 *CLI, *modules, "--lora", "style=0.5", "--lora", "product"]) == 0
    assert_pixels_of(_cli_image(tmp_path / "both.png"), reference(loras={"product": 0.7, "style": 1.0}))
    assert_pixels_of(_cli_image(tmp_path / "none.png"), reference())
    assert_pixels_of(_cli_image(tmp_path / "flags.png"), reference(loras={"style": 0.5, "product": 1.0}))


@pytest.mark.parametrize("flags, expected", [
    (["--lora", "=1"], "--lora: expected NAME or NAME=WEIGHT"),
    (["--lora", "style=high"], "--lora: the weight of 'style' must be a number"),
    (["--lora", "style=nan"], "--lora: the weight of 'style' must be a number in [-100, 100]"),
    (["--lora", "style", "--lora", "style=2"], "--lora: 'style' is given twice"),
    (["--lora", "other", "--lora-modules", "style=STYLE"],
     "--lora: unknown LoRA adapter(s) ['other']; --lora-modules loads ['style']"),
    (["--lora", "style"], "--lora: unknown LoRA adapter(s) ['style']; --lora-modules loads none"),
], ids=["no-name", "not-a-number", "nan", "twice", "unknown", "no-modules"])
@pytest.mark.slow
def test_bad_lora_flags_are_usage_errors(capsys, no_model_load, adapters, flags, expected):  # noqa: F811
    flags = [f"style={adapters['style']}" if flag == "style=STYLE" else flag for flag in flags]
    err = expect_usage_error(capsys, "generate", "x", "--device", "cpu", *flags)
    assert expected in err, err


@pytest.mark.parametrize("line, expected", [
    ({"prompt": "x", "loras": {"other": 1}}, ":2: unknown LoRA adapter(s) ['other']"),
    ({"prompt": "x", "loras": ["style"]}, ":2: loras must be an object"),
    ({"prompt": "x", "loras": {"style": "1"}}, ":2: loras: the weight of 'style' must be a number in [-100, 100]"),
], ids=["unknown", "not-an-object", "string-weight"])
def test_bad_jsonl_loras_are_usage_errors(capsys, no_model_load, adapters, tmp_path, line, expected):  # noqa: F811
    lines = tmp_path / "p.jsonl"
    lines.write_text("a plain line\n" + json.dumps(line) + "\n")
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(lines), "--device", "cpu",
                             "--lora-modules", f"style={adapters['style']}")
    assert expected in err, err


@pytest.mark.parametrize("flags, expected", [
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating without --enable-lora"),
    (["--served-model-name", "base", "--lora-modules", "base=STYLE"], "'base' is the --served-model-name"),
    (["--lora-modules", "style=/nonexistent/lora"], "lora_modules: style=/nonexistent/lora: LoRA path "),
    (["--lora-modules", "bad/name=STYLE"], "LoRA name must be"),
    (["--lora-modules", "style=MODEL"], "the folder holds no .safetensors file"),
    (["--lora-modules", "style=STYLE", "--max-lora-file-mb", "0.001"], "over max_lora_file_mb=0.001"),
    (["--max-lora-file-mb", "0", "--enable-lora"], "max_lora_file_mb must be a finite number > 0"),
], ids=["updating-without-lora", "adapter-named-as-the-model", "missing-path", "bad-name", "model-folder",
        "too-large", "zero-file-limit"])
@pytest.mark.slow
def test_bad_serve_lora_flags_are_usage_errors(capsys, no_model_load, sd_eps_path, adapters,  # noqa: F811
                                               flags, expected):
    """--lora-modules names and paths are checked with the other flags, before the model loads."""
    paths = {"STYLE": adapters["style"], "MODEL": sd_eps_path}
    flags = [flag.split("=")[0] + "=" + paths[flag.split("=")[1]] if flag.split("=")[-1] in paths else flag
             for flag in flags]
    err = expect_usage_error(capsys, "serve", "--device", "cpu", *flags)
    assert expected in err, err

