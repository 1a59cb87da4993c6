"""`dvllm serve` against a hostile web page and slow senders (issue 24, items 4 and 7): JSON routes take
only application/json (a page can send a body without a Content-Type, and without a CORS preflight), '*'
with credentials is refused, refused preflights are JSON; a body must arrive within --body-timeout (408,
connection closed) and at most --max-pending-bodies may be arriving at once (429, unread)."""
from __future__ import annotations

import argparse
import json
import select
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from utils_cli import expect_usage_error, no_model_load, restore_logging, serve_args  # noqa: F401 (fixtures)
from utils_server import BASE_ARGS, FAST, WAIT, RemoteServer, assert_error, metrics, wait_until

from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app


ORIGIN = "https://app.example"
ROUTES = {"/v1/images/generations": {"prompt": "a", **FAST},
          "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/tmp/x"},
          "/v1/unload_lora_adapter": {"lora_name": "x"}}


@pytest.fixture(scope="module")
def engine(sd_eps_path):
    return AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=16)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, argparse.Namespace(allow_runtime_lora_updating=True)),
                    raise_server_exceptions=False) as c:
        yield c


# -- item 4: JSON only as application/json ----------------------------------------------------------

@pytest.mark.parametrize("route", list(ROUTES))
def test_a_json_body_without_content_type_is_415_and_reaches_no_engine(client, monkeypatch, route):
    calls = []
    engine = client.app.state.ctx.engine
    for name in ("generate", "load_lora", "unload_lora"):
        monkeypatch.setattr(engine, name, lambda *args, name=name: calls.append(name))
    response = client.post(route, content=json.dumps(ROUTES[route]))  # httpx sends no Content-Type for bytes
    assert "content-type" not in response.request.headers
    error = assert_error(response, 415)
    assert error["code"] == "unsupported_media_type" and "got none" in error["message"], error
    assert calls == []


def test_json_with_a_charset_is_still_json(client):
    response = client.post("/v1/images/generations", content=json.dumps(ROUTES["/v1/images/generations"]),
                           headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text


# -- item 4: CORS ------------------------------------------------------------------------------------

@pytest.mark.parametrize("origins", ["*", f'["{ORIGIN}", "*"]'])
def test_any_origin_with_credentials_fails_before_the_model_loads(capsys, no_model_load, origins):  # noqa: F811
    err = expect_usage_error(capsys, "serve", "--allowed-origins", origins, "--allow-credentials")
    assert "--allowed-origins '*' with --allow-credentials" in err, err


def test_build_app_refuses_any_origin_with_credentials(engine):
    listeners = list(engine.step_listeners)
    with pytest.raises(ValueError, match="--allow-credentials"):
        build_app(engine, argparse.Namespace(allowed_origins=["*"], allow_credentials=True))
    assert engine.step_listeners == listeners  # refused before the app touched the engine
    build_app(engine, argparse.Namespace(allowed_origins=[ORIGIN], allow_credentials=True))  # named origins: fine


def preflight(client: TestClient, origin: str = ORIGIN, method: str = "POST", headers: str = "content-type"):
    return client.options("/v1/images/generations", headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})


def test_a_refused_preflight_is_json_and_keeps_its_cors_headers(engine):
    client = TestClient(build_app(engine, serve_args("--allowed-origins", ORIGIN, "--allowed-methods", "GET,POST",
                                                     "--allowed-headers", "content-type")))
    assert preflight(client).status_code == 200
    for response, refused in [(preflight(client, origin="https://evil.example"), "origin"),
                              (preflight(client, method="DELETE"), "method"),
                              (preflight(client, headers="x-custom"), "headers")]:
        error = assert_error(response, 400, param=None)
        assert error["code"] == "cors_not_allowed" and refused in error["message"], error
        assert response.headers["content-type"] == "application/json"
        assert "Origin" in response.headers["vary"] and "POST" in response.headers["access-control-allow-methods"]
    # An allowed origin refused for its method or headers still may read why; another origin may not.
    assert preflight(client, headers="x-custom").headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight(client, origin="https://evil.example").headers


# -- item 7: flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    (["--body-timeout", "0"], "--body-timeout must be > 0"),
    (["--body-timeout", "nan"], "--body-timeout must be > 0"),
    (["--max-pending-bodies", "0"], "--max-pending-bodies must be >= 1"),
])
def test_bad_body_flags_fail_before_the_model_loads(capsys, no_model_load, flags, expected):  # noqa: F811
    assert expected in expect_usage_error(capsys, "serve", *flags)


def test_body_flags_reach_the_app(engine):
    limits = build_app(engine, serve_args("--body-timeout", "5", "--max-pending-bodies", "3")).state.ctx.body_limits
    assert (limits.timeout, limits.max_receiving) == (5.0, 3)
    limits = build_app(engine, serve_args()).state.ctx.body_limits
    assert (limits.timeout, limits.max_receiving) == (30.0, 32)


# -- item 7: a real server and bare sockets ----------------------------------------------------------

def start_body(url: str, head: bytes = b'{"prompt": "a"', declared: int = 10_000,
               extra: str = "") -> socket.socket:
    """A generation request whose headers promise `declared` bytes, of which only `head` is sent."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    sock.sendall((f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {declared}\r\n{extra}\r\n").encode() + head)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """The server's answer, read until it closes the connection (a socket timeout, WAIT, if it never does)."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def trickle_until_answered(sock: socket.socket, every: float = 0.2) -> None:
    """Sends the body one byte (JSON whitespace) at a time, never all of it, until the server answers."""
    for _ in range(int(WAIT / every)):
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            return
        sock.sendall(b" ")
    raise AssertionError("the server never answered a body that kept trickling")


@pytest.fixture(scope="module")
def slow_server(sd_eps_path):
    with RemoteServer(sd_eps_path, [*BASE_ARGS, "--body-timeout", "3", "--request-timeout", "1"]) as server:
        yield server


@pytest.mark.slow
def test_a_trickled_body_is_408_and_its_connection_closed(slow_server):
    sock = start_body(slow_server.url)
    trickle_until_answered(sock)
    status, headers, body = read_until_closed(sock)
    assert status == 408 and headers["connection"] == "close", (status, headers)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "request_timeout"
    assert "--body-timeout" in body["error"]["message"]
    assert httpx.get(slow_server.url + "/health", timeout=WAIT).status_code == 200


@pytest.mark.slow
def test_request_timeout_counts_from_the_bodys_arrival(slow_server):
    """A body slower than --request-timeout (1 s) but within --body-timeout (3 s) is served, not 504:
    here a bad sampler, refused at admission, is its 400."""
    body = json.dumps({"prompt": "a", **FAST, "sampler": "nope"}).encode()
    sock = start_body(slow_server.url, body[:10], declared=len(body), extra="Connection: close\r\n")
    time.sleep(2.0)  # the slow upload under test; no answer can come before the body is complete
    sock.sendall(body[10:])
    status, _, answer = read_until_closed(sock)
    assert status == 400 and answer["error"]["param"] == "sampler", (status, answer)


@pytest.fixture(scope="module")
def gate_server(sd_eps_path):
    with RemoteServer(sd_eps_path, [*BASE_ARGS, "--max-pending-bodies", "2"]) as server:
        yield server


@pytest.mark.slow
def test_bodies_arriving_at_once_are_bounded(gate_server):
    url = gate_server.url
    generate = url + "/v1/images/generations"
    gone = 'dvllm_requests_total{outcome="disconnected"}'
    before = metrics(url)[gone]
    held = [start_body(url) for _ in range(2)]
    try:
        # A complete (bad) body is a 400 until both held bodies are being received, then a 429.
        wait_until(lambda: httpx.post(generate, json={}, timeout=WAIT).status_code == 429,
                   what="the two held bodies to fill --max-pending-bodies 2")
        status, headers, body = read_until_closed(start_body(url))  # refused unread: no 408 after 30 s
        assert status == 429 and headers["retry-after"] and headers["connection"] == "close", (status, headers)
        assert body["error"]["code"] == "rate_limit_exceeded" and "--max-pending-bodies 2" in body["error"]["message"]
        assert httpx.get(url + "/health", timeout=WAIT).status_code == 200
    finally:
        for sock in held:
            sock.close()
    # Their senders left: counted as disconnected (not a 500), and their places are free again.
    wait_until(lambda: metrics(url)[gone] >= before + 2, what="the held bodies' clients to be seen gone")
    response = httpx.post(generate, json={"prompt": "a", **FAST}, timeout=WAIT)
    assert response.status_code == 200, response.text


def trickle_until_closed(sock: socket.socket, every: float = 0.2) -> bytes:
    """What the server sends while the body keeps trickling, one byte at a time, until it closes the connection."""
    received = b""
    for _ in range(int(WAIT / every)):
        if select.select([sock], [], [], every)[0]:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # closed with trickled bytes unread: a reset instead of an end of stream
                return received
            if not chunk:
                return received
            received += chunk
        else:
            try:
                sock.sendall(b" ")
            except OSError:  # reset: closed with the trickle unread
                return received
    raise AssertionError(f"the connection stayed open while its body trickled; the server sent {received!r}")


@pytest.fixture(scope="module")
def keyed_server(sd_eps_path):
    with RemoteServer(sd_eps_path, [*BASE_ARGS, "--api-key", "sk-test", "--body-timeout", "2"]) as server:
        yield server


@pytest.mark.slow
def test_a_refusal_before_the_body_is_read_closes_a_trickling_connection(keyed_server):
    """A 401 (no key) or 415 answered before the body was read used to leave the connection open, so its sender
    could trickle the body for ever, outside --max-pending-bodies and --body-timeout. Now the body is received
    and dropped within those bounds (--body-timeout 2 here), and past them the connection closes."""
    host, port = keyed_server.url.removeprefix("http://").split(":")
    for extra, status in (("Content-Type: application/json\r\n", 401),
                          ("Authorization: Bearer sk-test\r\nContent-Type: text/plain\r\n", 415)):
        sock = socket.create_connection((host, int(port)), timeout=WAIT)
        sock.sendall((f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Length: 10000\r\n"
                      f"{extra}\r\n").encode() + b'{"prompt": "a"')
        answer = trickle_until_closed(sock)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()) and b"connection: close" in answer.lower(), answer
    # A refusal after the whole body was read keeps the connection, as before; so does one before it was read
    # when the body arrives at once (dropped, not left unread: closing then would reset the connection, and the
    # client could lose the answer).
    with httpx.Client(timeout=WAIT) as client:
        url = keyed_server.url + "/v1/images/generations"
        bad = client.post(url, json={"prompt": "a", "sampler": "nope"}, headers={"Authorization": "Bearer sk-test"})
        assert bad.status_code == 400 and bad.headers.get("connection") != "close", bad.headers
        big = {"prompt": "a", "negative_prompt": "y" * 200_000}  # under --max-body-mb 0.25, refused unread
        unauthorized = client.post(url, json=big)
        assert unauthorized.status_code == 401 and unauthorized.headers.get("connection") != "close"
