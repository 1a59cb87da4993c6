"""`dvllm serve` as an operator meets it: flags checked before the model loads, a taken port, quiet
start-up, CORS (vLLM's flag names), TLS, and signals during the shutdown drain."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from utils_cli import (  # noqa: F401 (fixtures)
    assert_quiet, cli, expect_usage_error, no_model_load, restore_logging, serve_args)
from utils_server import RemoteServer, wait_until

from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app

BASE_ARGS = ["--device", "cpu", "--dtype", "float32", "--state-pool-mb", "32", "--log-level", "warning"]
ORIGIN = "https://app.example"


# -- checked before the model loads ----------------------------------------------------------------

@pytest.mark.parametrize("flags,expected", [
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "cert.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/nonexistent/cert.pem"],
     "cannot load the TLS certificate"),
    (["--allowed-methods", "GET"], "--allowed-methods without --allowed-origins"),
    (["--allow-credentials"], "--allow-credentials without --allowed-origins"),
    (["--allowed-origins", '["https://a.example", 1]'], "must be a JSON list of strings"),
    (["--allowed-origins", '["https://a.example"'], "not a JSON list"),
    (["tiny-shape"], "did you mean 'tiny-shapes'"),
    (["--model", "sd-trubo"], "did you mean 'sd-turbo'"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--port", "70000"], "--port"),
    (["--public-url", "images.example.com"], "--public-url must be an http:// or https:// URL"),
    (["--image-store-mb", "-1"], "--image-store-mb must be >= 0"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_serve_flags_fail_before_the_model_loads(capsys, no_model_load, flags, expected):  # noqa: F811
    err = expect_usage_error(capsys, "serve", *flags)
    assert expected in err, err


def test_taken_port_fails_at_once_without_loading_the_model(sd_eps_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # --log-level info: a model load would show as the state pool's log line
        proc = subprocess.run(cli("serve", sd_eps_path, "--port", str(port), "--device", "cpu", "--log-level", "info"),
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"dvllm serve: error: cannot bind 127.0.0.1:{port}: the address is already in use "
                     "(another server on that port? pick another with --port)"], proc.stderr
    assert "state pool" not in proc.stdout + proc.stderr


# -- CORS: build_app with vLLM's flags --------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(sd_eps_path):
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32)
    yield engine
    asyncio.run(engine.shutdown(0))


def preflight(client: TestClient, origin: str = ORIGIN, headers: str = "authorization,content-type"):
    return client.options("/v1/images/generations", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers})


def test_no_cors_headers_by_default(engine):
    client = TestClient(build_app(engine, serve_args()))  # no lifespan: the routes used need no engine loop
    assert "access-control-allow-origin" not in preflight(client).headers
    assert "access-control-allow-origin" not in client.get("/version", headers={"Origin": ORIGIN}).headers


@pytest.mark.parametrize("origins", [f'["{ORIGIN}", "https://other.example"]', f"{ORIGIN},https://other.example"],
                         ids=["json-list", "comma-separated"])
def test_cors_for_the_allowed_origins(engine, origins):
    client = TestClient(build_app(engine, serve_args("--allowed-origins", origins, "--api-key", "sk-x")))
    r = preflight(client)
    assert r.status_code == 200  # a preflight carries no credentials: the API key must not block it
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    # The real request, refused for want of a key, still tells the browser it may read the error.
    denied = client.post("/v1/images/generations", json={"prompt": "x"}, headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = preflight(client, origin="https://evil.example")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_cors_any_origin_and_narrowed_methods_headers_credentials(engine):
    client = TestClient(build_app(engine, serve_args("--allowed-origins", "*")))
    assert preflight(client, origin="https://anywhere.example").headers["access-control-allow-origin"] == "*"
    assert client.get("/version", headers={"Origin": "https://x.example"}).headers["access-control-allow-origin"] == "*"

    client = TestClient(build_app(engine, serve_args("--allowed-origins", ORIGIN, "--allowed-methods", '["get"]',
                                                     "--allowed-headers", "content-type", "--allow-credentials")))
    assert preflight(client, headers="content-type").status_code == 400  # POST is not allowed
    r = client.options("/version", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET",
                                            "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
    bad_header = client.options("/version", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET",
                                                     "Access-Control-Request-Headers": "x-custom"})
    assert bad_header.status_code == 400


def test_server_flags_reach_the_app(engine):
    app = build_app(engine, serve_args("--public-url", "https://images.example/", "--allow-client-priority",
                                       "--image-store-size", "3"))
    ctx = app.state.ctx
    assert ctx.public_url == "https://images.example" and ctx.allow_client_priority
    assert build_app(engine, serve_args()).state.ctx.allow_client_priority is False


# -- TLS, and what start-up prints ------------------------------------------------------------------

def self_signed_cert(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, valid for a day: (keyfile, certfile)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    keyfile, certfile = folder / "key.pem", folder / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(keyfile), str(certfile)


class HTTPSServer(RemoteServer):
    """RemoteServer speaking https: readiness is polled over TLS (self-signed, so unverified)."""

    def _wait_ready(self, timeout: float) -> None:
        self.url = "https://" + self.url.removeprefix("http://")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dvllm serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0, verify=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"dvllm serve did not become healthy in {timeout} s:\n{self.log()[-3000:]}")


@pytest.fixture(scope="module")
def https_server(sd_eps_path, tmp_path_factory):
    keyfile, certfile = self_signed_cert(tmp_path_factory.mktemp("tls"))
    # The default --log-level (info): what an operator sees at start-up.
    with HTTPSServer(sd_eps_path, ["--device", "cpu", "--dtype", "float32", "--state-pool-mb", "32",
                                   "--ssl-keyfile", keyfile, "--ssl-certfile", certfile]) as s:
        yield s


@pytest.mark.slow
def test_https(https_server):
    assert https_server.url.startswith("https://")
    r = httpx.post(https_server.url + "/v1/images/generations", verify=False, timeout=60,
                   json={"prompt": "over TLS", "num_inference_steps": 2, "size": "16x16"})
    assert r.status_code == 200 and r.json()["data"][0]["b64_json"]
    with pytest.raises(httpx.TransportError):  # it speaks TLS only
        httpx.get(https_server.url.replace("https://", "http://") + "/health", timeout=10)
    assert f"Uvicorn running on {https_server.url}" in https_server.log()


@pytest.mark.slow
def test_serve_start_up_is_quiet(https_server):
    log = https_server.log()  # the same server: one model load fewer
    assert "Application startup complete" in log and "state pool" in log  # dvllm's and uvicorn's lines stay
    assert_quiet(log)
    # what a newcomer needs from start-up: the model, where it runs, its capacity, and where to reach it
    assert re.search(r"serving \S+ \(stable-diffusion\) on cpu in float32: the state pool holds \d+ requests", log)
    assert f"the OpenAI Images API at {https_server.url}/v1" in log and f"the playground at {https_server.url}/" in log


# -- signals during the drain ---------------------------------------------------------------------

@pytest.mark.slow
def test_repeated_signals_during_the_drain_are_ignored_and_it_exits_0(sd_eps_path):
    # Requests that cannot finish (20,000 euler steps: minutes here, 20 s even at 1 ms a step) keep the
    # server draining for its whole grace period; 20 s is far longer than sending three signals and seeing
    # each logged takes, so all three surely arrive during the drain, which then aborts both requests.
    endless = {"num_inference_steps": 20_000, "sampler": "euler", "size": "16x16"}
    wait = 120.0  # s: bound on waiting for what the server reports; reached only when it is broken
    args = [*BASE_ARGS, "--max-inference-steps", "20000", "--shutdown-grace", "20"]
    with RemoteServer(sd_eps_path, args) as s, ThreadPoolExecutor(2) as pool:
        def post() -> httpx.Response:
            return httpx.post(s.url + "/v1/images/generations", timeout=wait, json={"prompt": "bye", **endless})

        def running() -> bool:
            text = httpx.get(s.url + "/metrics", timeout=wait).text
            return "dvllm_num_requests_running 2.0" in text

        def ignored(count: int) -> bool:  # or gone: then the exit status below tells what happened
            return s.log().count("while shutting down: ignored") >= count or s.proc.poll() is not None

        def draining() -> bool:
            try:
                return httpx.get(s.url + "/health", timeout=wait).status_code == 503
            except httpx.TransportError:
                return s.proc.poll() is not None

        requests = [pool.submit(post), pool.submit(post)]
        wait_until(running, timeout=wait, what="both requests to run")
        s.signal(signal.SIGTERM)
        wait_until(draining, timeout=wait, what="the drain to start")
        for count, sig in enumerate([signal.SIGTERM, signal.SIGINT, signal.SIGTERM], 1):
            s.signal(sig)
            wait_until(lambda count=count: ignored(count), timeout=wait, what=f"signal {count + 1} to be ignored")
        assert s.proc.poll() is None, "the drain ended before the signals were all sent"
        for future in requests:  # aborted when the grace period ends: a JSON 503, no 500, no dropped connection
            r = future.result()
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"]["message"]
        assert s.proc.wait(wait) == 0, s.log()[-3000:]
        assert s.log().count("while shutting down: ignored") == 3, s.log()[-3000:]
