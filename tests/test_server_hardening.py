"""What a careless or hostile client tries: each must be a 4xx naming the field, answered at admission,
never a 500, a stall or a number that silently changes meaning."""
from __future__ import annotations

import argparse
import io
import json
import logging
import socket
import struct
import threading
import zlib

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from utils_server import RemoteServer

from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.entrypoints.image_store import ImageStore
from dvllm.sampling_params import SamplingParams

MAX_CHARS = 1000
FAST = {"num_inference_steps": 2, "size": "16x16"}
PUBLIC_URL = "https://images.example.test"
WAIT = 120.0  # s: a bound reached only when something is broken


@pytest.fixture(scope="module")
def app_engine(sd_eps_path):
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=16,
                                  max_prompt_chars=MAX_CHARS)
    yield engine


@pytest.fixture(scope="module")
def client(app_engine):
    args = argparse.Namespace(served_model_name="tiny", public_url=PUBLIC_URL + "/")
    with TestClient(build_app(app_engine, args), raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, body: dict | str, headers: dict[str, str] | None = None):
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post("/v1/images/generations", content=content,
                       headers={"Content-Type": "application/json", **(headers or {})})


def assert_400(response, param: str, *fragments: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error
    assert " at 0x" not in error["message"] and "Traceback" not in error["message"]
    return error["message"]


# -- text fields --------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_text_over_max_prompt_chars_is_400_naming_the_field(client, field):
    body = {"prompt": "a", **FAST, field: "x" * (MAX_CHARS + 1)}
    assert_400(post(client, body), field, f"at most {MAX_CHARS} characters")
    assert post(client, {"prompt": "a", **FAST, field: "x" * MAX_CHARS}).status_code == 200


@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "model", "user", "sampler"])
def test_a_lone_surrogate_in_any_text_field_is_400(client, field):
    body = json.dumps({"prompt": "a", **FAST}).rstrip("}") + f', "{field}": "x\\ud800y"}}'
    assert_400(post(client, body), field)


# -- numbers and names --------------------------------------------------------------------------

@pytest.mark.parametrize("sampler", ["SchedulerMixin", "KarrasVeScheduler", "AmusedScheduler", "RePaintScheduler",
                                     "no_such_sampler"])
def test_a_sampler_that_cannot_run_is_400_listing_the_valid_ones(client, sampler):
    message = assert_400(post(client, {"prompt": "a", **FAST, "sampler": sampler}), "sampler", "valid samplers")
    valid = message.split("valid samplers:")[1]
    assert "'ddim'" in valid and "'euler_a'" in valid
    assert "'KarrasVeScheduler'" not in valid and "'SchedulerMixin'" not in valid
    # the class names only to someone who gave one; the short names to everyone
    assert ("'PNDMScheduler'" in valid) == sampler.endswith("Scheduler")


def test_a_misspelt_sampler_is_400_with_the_nearest_name(client):
    message = assert_400(post(client, {"prompt": "a", **FAST, "sampler": "eulr_a"}), "sampler", "did you mean")
    assert "did you mean 'euler_a'" in message and "Scheduler'" not in message
    message = assert_400(post(client, {"prompt": "a", **FAST, "sampler": "EulerDiscretScheduler"}), "sampler")
    assert "did you mean 'EulerDiscreteScheduler'" in message


def test_a_diffusers_scheduler_that_runs_is_still_served(client):
    assert post(client, {"prompt": "a", **FAST, "sampler": "HeunDiscreteScheduler"}).status_code == 200


def test_more_steps_than_the_sampler_runs_is_400_saying_how_many_it_runs(client):
    # The tiny model's DDIM (leading spacing, steps_offset 1) indexes past its 1000 training steps at 1000.
    message = assert_400(post(client, {"prompt": "a", "size": "16x16", "num_inference_steps": 1000}),
                         "num_inference_steps", "at most 999")
    for internal in ("index", "tensor", "Error", "dimension"):
        assert internal not in message


@pytest.mark.parametrize("body, param", [
    ({"guidance_scale": 1e308}, "guidance_scale"),
    ({"guidance_scale": 100.5}, "guidance_scale"),
    ({"priority": 10**30}, "priority"),
    ({"priority": 3}, "priority"),  # clients' priorities are off unless the server allows them
    ({"deadline": 0}, "deadline"),
    ({"size": " 16x16"}, "size"),
    ({"size": "16X16"}, "size"),
    ({"size": "\uff11\uff16x16"}, "size"),  # full-width digits
    ({"size": "16x16 "}, "size"),
])
def test_out_of_range_and_loosely_written_values_are_400(client, body, param):
    assert_400(post(client, {"prompt": "a", "num_inference_steps": 2, "size": "16x16", **body}), param)


def test_client_priority_is_honoured_when_the_server_allows_it(client, app_engine):
    allowed = build_app(app_engine, argparse.Namespace(allow_client_priority=True))  # the flag reaches the app
    assert allowed.state.ctx.allow_client_priority and not client.app.state.ctx.allow_client_priority
    client.app.state.ctx.allow_client_priority = True
    try:
        assert post(client, {"prompt": "a", **FAST, "priority": -5}).status_code == 200
    finally:
        client.app.state.ctx.allow_client_priority = False


def test_a_deadline_is_taken_where_it_reports_and_gated_where_it_moves_a_request_ahead(client):
    ctx = client.app.state.ctx
    assert not ctx.deadlines_reorder  # a static engine: the deadline is only reported
    answer = post(client, {"prompt": "a", **FAST, "deadline": 3600})
    assert answer.status_code == 200, answer.text
    ctx.deadlines_reorder = True  # as on an elastic group
    try:
        assert "--group-policy elastic" in assert_400(post(client, {"prompt": "a", **FAST, "deadline": 30}),
                                                      "deadline")
        ctx.allow_client_priority = True
        answer = post(client, {"prompt": "a", **FAST, "deadline": 3600})
        assert answer.status_code == 200, answer.text
    finally:
        ctx.deadlines_reorder = ctx.allow_client_priority = False


# -- responses ----------------------------------------------------------------------------------

def test_image_urls_use_the_public_url_not_the_clients_host_header(client):
    r = post(client, {"prompt": "a", **FAST, "response_format": "url"}, headers={"Host": "evil.example"})
    assert r.status_code == 200, r.text
    url = r.json()["data"][0]["url"]
    assert url.startswith(PUBLIC_URL + "/v1/images/"), url
    assert client.get(url.removeprefix(PUBLIC_URL)).status_code == 200


def test_each_of_n_images_reports_the_request_seed_and_its_index(client):
    r = post(client, {"prompt": "a", **FAST, "n": 3, "seed": 7})
    assert [(d["seed"], d["index"]) for d in r.json()["data"]] == [(7, 0), (7, 1), (7, 2)]


@pytest.mark.parametrize("route", ["generations", "edits"])
def test_get_on_either_post_route_is_405(client, route):
    r = client.get(f"/v1/images/{route}")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_unknown_fields_are_logged_briefly_and_once(client, caplog):
    body = {"prompt": "a", **FAST, **{f"unknown_field_{i}": 1 for i in range(20_000)}}
    with caplog.at_level(logging.WARNING, logger="dvllm.entrypoints.serving_images"):
        assert post(client, body).status_code == 200
        first = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
        assert len(first) == 1 and len(first[0]) < 1000 and "19995 more" in first[0]
        caplog.clear()
        assert post(client, {"prompt": "a", **FAST, "unknown_field_0": 1}).status_code == 200
        assert not [r for r in caplog.records if "unknown field" in r.getMessage()]  # logged already


def test_the_url_image_store_is_bounded_in_bytes():
    store = ImageStore(capacity=100, max_bytes=1000)
    ids = [store.put(bytes(400), "png") for _ in range(5)]
    assert store.num_bytes <= 1000 and len(store) == 2
    assert store.get(ids[0]) is None and store.get(ids[-1]) is not None


# -- uploads (/v1/images/edits) -------------------------------------------------------------------

def png_header_only(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes that claims a size: a valid header, then one row of pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def edit(client: TestClient, image: bytes, **fields: str):
    data = {"prompt": "a", "num_inference_steps": "2", **fields}
    return client.post("/v1/images/edits", data=data, files={"image": ("in.png", image, "image/png")})


def real_png(size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("image, fragment", [
    (png_header_only(13000, 13000), "13000x13000 is over"),  # 169 Mpx in a few bytes: refused from the header
    (png_header_only(20000, 20000), ""),  # past PIL's decompression-bomb limit: PIL refuses to open it
    (b"not an image at all", "not a readable image"),
    (real_png()[:60], "cannot read it"),  # a valid header, then the data stops: fails when decoded
])
def test_bad_uploads_are_400_naming_image(client, image, fragment):
    assert_400(edit(client, image), "image", fragment)


@pytest.mark.parametrize("field, value", [("seed", "1_000"), ("num_inference_steps", " 2"), ("seed", "\uff11"),
                                          ("guidance_scale", "inf")])
def test_form_numbers_are_parsed_strictly(client, field, value):
    assert_400(edit(client, real_png(), **{field: value}), field)


def test_a_good_upload_still_edits(client):
    r = edit(client, real_png(), seed="1000", strength="0.5")
    assert r.status_code == 200, r.text


# -- engine defaults ------------------------------------------------------------------------------

def test_random_seeds_stay_exact_in_javascript(app_engine):
    seeds = [SamplingParams().resolve(app_engine.model_info, app_engine.config).seed for _ in range(256)]
    assert all(0 <= s < 2**53 for s in seeds) and len(set(seeds)) > 250


def test_max_image_pixels_defaults_to_four_times_the_models_area(app_engine):
    info = app_engine.model_info
    limit = 4 * info.defaults.height * info.defaults.width
    side = info.defaults.height * 2
    assert side * side == limit  # the largest square allowed
    SamplingParams(height=side, width=side).resolve(info, app_engine.config)
    with pytest.raises(ValueError, match=f"at most {limit} pixels"):
        SamplingParams(height=side + info.latents.size_factor, width=side).resolve(info, app_engine.config)


# -- the step loop is never where a request waits to be refused ------------------------------------

def test_a_bad_request_is_answered_while_the_step_loop_is_busy(client, app_engine):
    """Validation runs at admission, off the step loop: with the loop held inside a step (a listener
    that blocks it), a bad request is still refused, and only then is the loop let go."""
    busy, release = threading.Event(), threading.Event()

    def hold_the_loop(stats, outputs) -> None:
        busy.set()
        release.wait(WAIT)

    app_engine.step_listeners.append(hold_the_loop)
    answers: dict[str, object] = {}
    good = threading.Thread(target=lambda: answers.update(good=post(client, {"prompt": "a", **FAST})))
    try:
        good.start()
        assert busy.wait(WAIT), "the good request never took a step"
        bad = threading.Thread(target=lambda: answers.update(
            bad=post(client, {"prompt": "a", **FAST, "sampler": "foo"}),
            bad_while_busy=not release.is_set()))
        bad.start()
        bad.join(WAIT)
        assert answers.get("bad_while_busy") is True, "the bad request waited for the step loop"
        assert_400(answers["bad"], "sampler")
    finally:
        release.set()
        app_engine.step_listeners.remove(hold_the_loop)
        good.join(WAIT)
    assert answers["good"].status_code == 200


@pytest.fixture(scope="module")
def queue_of_two(sd_eps_path):
    args = ["--device", "cpu", "--dtype", "float32", "--state-pool-mb", "16", "--max-queue-len", "2",
            "--max-inference-steps", "20000", "--log-level", "warning"]
    with RemoteServer(sd_eps_path, args) as server:
        yield server


def open_stream(url: str, body: dict) -> socket.socket:
    """A streamed request on a bare socket, returned once its response has begun (it is running)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return sock


@pytest.mark.slow
def test_disconnected_requests_do_not_count_against_the_queue_limit(queue_of_two):
    endless = {"prompt": "a", "num_inference_steps": 20_000, "sampler": "euler", "size": "16x16"}
    for _ in range(3):
        streams = [open_stream(queue_of_two.url, endless) for _ in range(2)]  # the queue is full
        for sock in streams:
            sock.close()
        r = httpx.post(queue_of_two.url + "/v1/images/generations", json={"prompt": "a", **FAST}, timeout=WAIT)
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_only_streamed_requests_ask_for_progress_outputs():
    from dvllm.entrypoints.protocol import ImageGenerationRequest

    assert ImageGenerationRequest.parse({"prompt": "a"}).sampling_params().output_kind == "final"
    streamed = ImageGenerationRequest.parse({"prompt": "a", "stream": True, "partial_images": 2}).sampling_params()
    assert streamed.output_kind == "progress" and streamed.num_previews == 2


@pytest.mark.slow
def test_a_request_given_up_is_aborted_once(client, app_engine, monkeypatch):
    """A timeout (504) ends the engine stream, and that alone aborts the request: one abort command."""
    sent = []
    real = app_engine._send
    monkeypatch.setattr(app_engine, "_send", lambda *command: sent.append(command[0]) or real(*command))
    ctx = client.app.state.ctx
    monkeypatch.setattr(ctx, "request_timeout", 2.0)  # 900 steps take far longer on any CPU
    r = post(client, {"prompt": "a", "num_inference_steps": 900, "sampler": "euler", "size": "16x16"})
    assert r.status_code == 504
    assert sent.count("abort") == 1 and sent.count("add") <= 1
