"""`dvllm serve` end to end: the real server in a subprocess, driven by the openai client and raw httpx.

Servers on the tiny saved pipeline: `server` (auth off, small limits) for most tests, `keyed` (--api-key,
--max-queue-len 1, no timeout) for auth and 429, `limited` (--api-key, --request-timeout 2) for 504 (the
SIGTERM tests are in test_api_shutdown.py). No test may depend on how fast the machine is: a request that
must outlast something has ENDLESS steps, and the tests wait on what the server reports (/metrics,
response headers), never on the clock; the time bounds they do have are only reached when something is
broken.
"""
from __future__ import annotations

import base64
import io
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from utils_server import (
    BASE_ARGS,
    ENDLESS,
    FAST,
    MAX_STEPS,
    WAIT,
    RemoteServer,
    assert_error,
    assert_idle,
    metrics,
    png_pixels,
    raw_post,
    running,
    wait_until,
)

from dvllm import DiffusionEngine, SamplingParams

MODEL = "tiny"
KEY = "sk-test-key"
SERVER_ARGS = [*BASE_ARGS, "--served-model-name", MODEL]
LONG = 900  # steps: far longer than any test waits (about 10 ms each here)


@pytest.fixture(scope="module")
def server(sd_eps_path):
    with RemoteServer(sd_eps_path, SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(sd_eps_path):
    """Auth on and one request in flight at most, but no --request-timeout: what these tests send may
    take as long as a loaded machine needs."""
    args = [*SERVER_ARGS, *MAX_STEPS, "--max-queue-len", "1"]
    with RemoteServer(sd_eps_path, args, env={"DVLLM_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def limited(sd_eps_path):
    """A 2 s --request-timeout: only for requests meant to outlast it."""
    args = [*SERVER_ARGS, *MAX_STEPS, "--max-queue-len", "1", "--request-timeout", "2"]
    with RemoteServer(sd_eps_path, args, env={"DVLLM_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def stream_limited(sd_eps_path):
    """A 15 s --request-timeout, for a stream meant to outlast it: long enough for the first step's
    output (the stream's headers) to go out however loaded the machine, so the timeout surely comes
    mid-stream, and short enough that an ENDLESS request cannot finish first."""
    args = [*SERVER_ARGS, *MAX_STEPS, "--request-timeout", "15"]
    with RemoteServer(sd_eps_path, args, env={"DVLLM_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# -- the openai client --------------------------------------------------------------------------

@pytest.mark.slow
def test_openai_client_plain(client):
    result = client.images.generate(model=MODEL, prompt="a red circle", size="16x16", n=2,
                                    extra_body={"seed": 7, "num_inference_steps": 4})
    assert result.size == "16x16" and result.output_format == "png" and len(result.data) == 2
    for image in result.data:
        assert png_pixels(image.b64_json).shape == (16, 16, 3)
        assert image.model_extra["seed"] == 7  # n images drawn from one generator seeded once
    again = client.images.generate(prompt="a red circle", size="16x16",
                                   extra_body={"seed": 7, "num_inference_steps": 4})
    assert np.array_equal(png_pixels(again.data[0].b64_json), png_pixels(result.data[0].b64_json))


def test_openai_client_streams_partial_images_then_the_image(client):
    stream = client.images.generate(model=MODEL, prompt="a blue square", size="16x16", stream=True, partial_images=2,
                                    extra_body={"seed": 3, "num_inference_steps": 6})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    steps = [e.model_extra["step"] for e in events[:2]]
    assert steps == sorted(steps) and 1 <= steps[0] and steps[-1] <= 6
    for e in events[:2]:  # the engine's estimate, after a measured step (its value depends on the machine)
        assert e.model_extra["num_steps"] == 6 and math.isfinite(e.model_extra["eta_seconds"])
        assert e.model_extra["eta_seconds"] >= 0
    for e in events:
        assert e.size == "16x16" and e.output_format == "png" and e.created_at > 0
        assert png_pixels(e.b64_json).shape == (16, 16, 3)
    done = events[-1]
    assert done.usage.total_tokens == 0 and done.model_extra["seed"] == 3
    plain = client.images.generate(prompt="a blue square", size="16x16",
                                   extra_body={"seed": 3, "num_inference_steps": 6})
    assert np.array_equal(png_pixels(done.b64_json), png_pixels(plain.data[0].b64_json))  # previews change nothing


@pytest.mark.slow
def test_models_health_version(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_models_lists_the_sizes_and_samplers_the_model_takes(http):
    """The card's `dvllm` facts are what the playground's menus hold: each size it lists is served, the next
    size past its limit is refused, and each sampler it lists runs."""
    facts = http.get("/v1/models").json()["data"][0]["dvllm"]
    assert facts["default_size"] in facts["sizes"] and len(facts["sizes"]) >= 2
    assert facts["sampler"].endswith("Scheduler") and "ddim" in facts["samplers"]
    # how the workers hold it: the loading layer's facts, beside the family's
    assert (facts["device"], facts["dtype"], facts["vae_dtype"], facts["quantization"]) == ("cpu", "float32",
                                                                                            "float32", None)
    body = {"prompt": "x", "num_inference_steps": 1}
    for size in facts["sizes"]:
        assert http.post("/v1/images/generations", json={**body, "size": size}).status_code == 200, size
    side = facts["size_multiple"] * (int(facts["max_image_pixels"] ** 0.5) // facts["size_multiple"] + 1)
    assert http.post("/v1/images/generations", json={**body, "size": f"{side}x{side}"}).status_code == 400
    for sampler in [s for s in facts["samplers"] if not s.endswith("Scheduler")]:
        assert http.post("/v1/images/generations", json={**body, "sampler": sampler}).status_code == 200, sampler


def test_url_store_and_output_formats(http):
    r = http.post("/v1/images/generations", json={"prompt": "x", "response_format": "url", "seed": 1, **FAST})
    url = r.json()["data"][0]["url"]
    image = httpx.get(url)
    assert image.headers["content-type"] == "image/png" and Image.open(io.BytesIO(image.content)).size == (16, 16)
    for fmt, pil_name in (("jpeg", "JPEG"), ("webp", "WEBP")):
        r = http.post("/v1/images/generations", json={"prompt": "x", "output_format": fmt, "output_compression": 50,
                                                      **FAST})
        assert r.json()["output_format"] == fmt
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).format == pil_name


def test_inapplicable_and_unknown_fields_are_ignored(http):
    r = http.post("/v1/images/generations", json={
        "prompt": "x", "quality": "high", "background": "transparent", "moderation": "low", "style": "vivid",
        "user": "u1", "size": "auto", "made_up_field": [1, 2], **{k: v for k, v in FAST.items() if k != "size"}})
    assert r.status_code == 200 and r.json()["size"] == "16x16"  # auto = the model's default


# -- bad input: 4xx in OpenAI's shape, never a trace, and the server stays healthy ------------------

BAD_BODIES = [  # (body, status, param)
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x" * 32001}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": "2"}, 400, "n"),
    ({"prompt": "x", "n": 5}, 400, "n"),  # over --max-images-per-prompt
    ({"prompt": "x", "size": "big"}, 400, "size"),
    ({"prompt": "x", "size": "20x16"}, 400, "size"),  # not a multiple of 8
    ({"prompt": "x", "size": "128x128"}, 400, "size"),  # over --max-image-pixels
    ({"prompt": "x", "response_format": "gif"}, 400, "response_format"),
    ({"prompt": "x", "output_format": "bmp"}, 400, "output_format"),
    ({"prompt": "x", "output_compression": 101}, 400, "output_compression"),
    ({"prompt": "x", "stream": True, "partial_images": 4}, 400, "partial_images"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream": True, "n": 2}, 400, "n"),  # a stream carries one image
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 1001}, 400, "num_inference_steps"),  # over max_inference_steps
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": "high"}, 400, "guidance_scale"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "seed": 2**63}, 400, "seed"),
    ({"prompt": "x", "sampler": "nope"}, 400, "sampler"),
    ({"prompt": "x", "priority": 1.5}, 400, "priority"),
    ({"prompt": "x", "negative_prompt": ["a"]}, 400, "negative_prompt"),
    ({"prompt": "x", "user": 5}, 400, "user"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
]

BAD_RAW = [  # (method, path, content, content type, status)
    ("POST", "/v1/images/generations", b'{"prompt": ', "application/json", 400),  # malformed JSON
    ("POST", "/v1/images/generations", b'["a red circle"]', "application/json", 400),  # not an object
    ("POST", "/v1/images/generations", b'{"prompt": "x", "guidance_scale": NaN}', "application/json", 400),
    ("POST", "/v1/images/generations", b"", "application/json", 400),  # empty body
    ("POST", "/v1/images/generations", b'{"prompt": "x"}', "text/plain", 415),
    ("POST", "/v1/images/generations", b"prompt=x", "application/x-www-form-urlencoded", 415),
    ("POST", "/v1/chat/completions", b'{"prompt": "x"}', "application/json", 404),  # unknown route
    ("GET", "/v1/nothing", b"", None, 404),
    ("GET", "/v1/images/deadbeef.png", b"", None, 404),  # never stored
    ("GET", "/v1/models/other", b"", None, 404),
    ("GET", "/v1/images/generations", b"", None, 405),
    ("DELETE", "/health", b"", None, 405),
]


@pytest.mark.parametrize("body, status, param", BAD_BODIES,
                         ids=[f"{i}-{list(b)[-1] if b else 'empty'}" for i, (b, _, _) in enumerate(BAD_BODIES)])
def test_bad_body_is_a_4xx_naming_the_field(http, body, status, param):
    assert_error(http.post("/v1/images/generations", json={**FAST, **body} if body else body), status, param)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("method, path, content, content_type, status", BAD_RAW)
def test_bad_request_is_a_4xx(http, method, path, content, content_type, status):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.request(method, path, content=content, headers=headers)
    assert_error(response, status, param="model" if "models/" in path else None if status != 404 else "any")
    if status == 405:
        assert response.headers["allow"]
    assert http.get("/health").status_code == 200


def test_body_over_the_limit_is_413(server, http):
    big = {"prompt": "x", "negative_prompt": "y" * 300_000}
    assert_error(http.post("/v1/images/generations", json=big), 413)  # by Content-Length

    def chunks():  # no Content-Length: the limit holds on what actually arrives
        body = json.dumps(big).encode()
        for i in range(0, len(body), 16384):
            yield body[i:i + 16384]
    assert_error(http.post("/v1/images/generations", content=chunks(), headers={"Content-Type": "application/json"}),
                 413)
    assert http.get("/health").status_code == 200


# -- fidelity under concurrency ---------------------------------------------------------------------

def test_16_concurrent_requests_equal_the_offline_engine(server, sd_eps_path):
    samplers = [None, "euler", "dpmpp_2m", "euler_a"]
    jobs = [{"prompt": f"prompt {i % 5}", "seed": 100 + i, "num_inference_steps": 3 + i % 4, "guidance_scale": 5.0,
             "sampler": samplers[i % 4], "size": "16x16", "n": 2 if i % 7 == 0 else 1} for i in range(16)]

    def post(job: dict) -> dict:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/v1/images/generations", json=job)
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(post, jobs))
    offline = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    expected = offline.generate([j["prompt"] for j in jobs], [
        SamplingParams(num_inference_steps=j["num_inference_steps"], guidance_scale=5.0, seed=j["seed"], n=j["n"],
                       sampler=j["sampler"], height=16, width=16, output_type="np") for j in jobs], use_tqdm=False)
    for job, got, want in zip(jobs, served, expected):
        assert len(got["data"]) == len(want.images) == job["n"]
        for image, reference in zip(got["data"], want.images):
            assert image["seed"] == job["seed"]
            ref = np.round(reference * 255).astype(np.int16)  # what the PIL conversion does before the PNG
            diff = np.abs(png_pixels(image["b64_json"]).astype(np.int16) - ref)
            # batching may move a float by ~1e-6, which can flip a value sitting on a rounding edge by one level
            assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (job, diff.max(), (diff != 0).sum())


# -- disconnects, load, metrics -----------------------------------------------------------------------

def test_disconnect_aborts_and_frees_state(server):
    before = metrics(server.url)['dvllm_requests_total{outcome="disconnected"}']
    plain = raw_post(server.url, {"prompt": "long", "num_inference_steps": LONG, "size": "16x16"})
    streamed = raw_post(server.url, {"prompt": "long", "num_inference_steps": LONG, "stream": True,
                                     "partial_images": 3, "size": "16x16"})
    wait_until(lambda: running(server.url) == 2, what="both requests to run")
    assert metrics(server.url)["dvllm_pool_used_blocks"] > 0
    plain.close()
    streamed.close()
    assert_idle(server.url)
    wait_until(lambda: metrics(server.url)['dvllm_requests_total{outcome="disconnected"}'] == before + 2,
               what="two disconnects counted")


def test_health_is_fast_while_the_engine_is_loaded(server):
    socks = [raw_post(server.url, {"prompt": f"load {i}", "num_inference_steps": LONG, "size": "16x16"})
             for i in range(8)]  # 8 x CFG = 16 rows: every step a full batch
    try:
        wait_until(lambda: running(server.url) == 8, what="8 running requests")
        times = []
        with httpx.Client(base_url=server.url, timeout=10) as c:
            for _ in range(30):
                start = time.perf_counter()
                assert c.get("/health").status_code == 200
                times.append(time.perf_counter() - start)
                time.sleep(0.01)
        print(f"/health under load: p50 {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")
        assert statistics.median(times) < 0.1
    finally:
        for s in socks:
            s.close()
    assert_idle(server.url)


def test_metrics_parse_with_the_expected_families(server, http):
    assert http.post("/v1/images/generations", json={"prompt": "m", **FAST}).status_code == 200
    assert http.post("/v1/images/generations", json={"prompt": "m", **FAST}).status_code == 200  # a cached prompt
    # its own bad request and repeated prompt: the tests before it in the module may not have run (-k, another order)
    assert http.post("/v1/images/generations", json={"prompt": "m", **FAST, "guidance_scale": -1}).status_code == 400
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("dvllm_requests", "dvllm_request_queue_time_seconds", "dvllm_request_latency_seconds",
                 "dvllm_step_time_seconds", "dvllm_batch_rows", "dvllm_num_requests_running",
                 "dvllm_num_requests_waiting", "dvllm_pool_used_blocks", "dvllm_pool_total_blocks",
                 "dvllm_prompt_cache_hit_rate", "dvllm_server_requests_in_flight"):
        assert name in families, name
    m = metrics(server.url)
    assert m['dvllm_requests_total{outcome="success"}'] >= 1 and m['dvllm_requests_total{outcome="bad_request"}'] >= 1
    assert m["dvllm_step_time_seconds_count"] >= 4 and m["dvllm_pool_total_blocks"] > 0
    assert 0 < m["dvllm_prompt_cache_hit_rate"] <= 1


# -- auth, 429, timeout ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_auth_on(keyed):
    # On `keyed`, not `limited`: under load even a 2-step request can take longer than a 2 s timeout.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(keyed.url + "/v1/images/generations", json={"prompt": "x", **FAST}, headers=headers,
                       timeout=WAIT)
        assert assert_error(r, 401)["code"] == "invalid_api_key"
        assert_error(httpx.get(keyed.url + "/v1/models", headers=headers, timeout=WAIT), 401)
    for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
        assert httpx.get(keyed.url + path, timeout=WAIT).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT)
    result = good.images.generate(prompt="x", model=MODEL, size="16x16", response_format="url",
                                  extra_body={"num_inference_steps": 2})
    assert httpx.get(result.data[0].url, timeout=WAIT).status_code == 200  # the random image id is the credential


def test_auth_off(http):
    assert http.get("/v1/models").status_code == 200  # `server` has no key


@pytest.mark.slow
def test_queue_full_is_429(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = metrics(keyed.url)
    # The slot holder cannot finish on its own and `keyed` has no timeout: it holds the one slot until
    # the test drops its connection, however slow or fast the machine.
    holder = raw_post(keyed.url, {"prompt": "slow", **ENDLESS}, headers=auth)
    try:
        # The gauge the 429 check itself reads: from here the server is full.
        wait_until(lambda: metrics(keyed.url)["dvllm_server_requests_in_flight"] == 1, what="the slot to be taken")
        r = httpx.post(keyed.url + "/v1/images/generations", json={"prompt": "x", **FAST}, headers=auth,
                       timeout=WAIT)
        assert assert_error(r, 429)["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    finally:
        holder.close()
    assert_idle(keyed.url)
    after = metrics(keyed.url)
    for outcome, count in (("rejected", 1), ("disconnected", 1), ("success", 0)):
        key = f'dvllm_requests_total{{outcome="{outcome}"}}'
        assert after[key] - before[key] == count, outcome


@pytest.mark.slow
def test_timeout_is_504(limited):
    before = metrics(limited.url)
    # ENDLESS outlasts the 2 s timeout on any machine; a slower one only makes the 504 surer.
    r = httpx.post(limited.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=WAIT, json={"prompt": "slow", **ENDLESS})
    assert assert_error(r, 504)["code"] == "timeout"
    assert_idle(limited.url)  # the timeout aborted the engine request and freed its state
    after = metrics(limited.url)
    for outcome, count in (("timeout", 1), ("success", 0), ("rejected", 0)):
        key = f'dvllm_requests_total{{outcome="{outcome}"}}'
        assert after[key] - before[key] == count, outcome


@pytest.mark.slow
def test_stream_timeout_ends_with_an_error_event(stream_limited):
    good = openai.OpenAI(base_url=stream_limited.url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT)
    # generate() returns with the stream's headers, which go out with the first step's output: well within
    # the 15 s timeout. ENDLESS cannot finish in 15 s, so the timeout then comes mid-stream.
    stream = good.images.generate(prompt="slow", model=MODEL, size="16x16", stream=True, partial_images=3,
                                  extra_body={k: v for k, v in ENDLESS.items() if k != "size"})
    with pytest.raises(openai.APIError, match="request-timeout"):
        list(stream)  # the stream had started, so the timeout arrives as an error event
    assert_idle(stream_limited.url)
