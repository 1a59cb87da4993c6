"""Faults a real engine cannot be made to show on demand, through build_app with a stub engine:
each must come back in OpenAI's error shape with the right status, never as a stack trace."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from dvllm.engine.async_engine import EngineDeadError
from dvllm.entrypoints.api_server import build_app
from dvllm.errors import QueueFullError
from dvllm.outputs import RequestMetrics, RequestOutput

STATS = {"num_running": 0, "num_waiting": 0, "num_preemptions": 0, "pool_total_blocks": 8, "pool_used_blocks": 0,
         "pool_cached_blocks": 0, "prompt_cache_hits": 0, "prompt_cache_queries": 0}


class StubEngine:
    """Quacks like AsyncDiffusionEngine; generate() does what `behaviour` says."""

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.loaded_model = SimpleNamespace(name="stub")
        self.step_listeners = []
        self.is_running = True
        self.aborted: list[str] = []

    def start(self) -> None:
        pass

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        self.is_running = False

    def stats(self) -> dict[str, int]:
        return dict(STATS)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt, params=None, request_id=None):
        result = self.behaviour(request_id)
        if isinstance(result, BaseException):
            raise result
        yield result


def final(request_id: str, error: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt="x", seed=1, num_inference_steps=1, num_steps_done=1,
                         finished=True, metrics=RequestMetrics(0.0, 0.0, 1.0), error=error,
                         images=[] if error else [Image.new("RGB", (16, 16))])


def call(behaviour) -> tuple[int, dict, dict]:
    engine = StubEngine(behaviour)
    with TestClient(build_app(engine, argparse.Namespace()), raise_server_exceptions=False) as client:
        r = client.post("/v1/images/generations", json={"prompt": "x"})
    return r.status_code, dict(r.headers), r.json()


def test_stub_success():
    status, _, body = call(lambda rid: final(rid))
    assert status == 200 and body["data"][0]["seed"] == 1 and body["size"] == "16x16"


@pytest.mark.parametrize("behaviour, status, code", [
    (lambda rid: QueueFullError("1 requests are waiting (max_num_waiting); retry later"), 429, "rate_limit_exceeded"),
    (lambda rid: EngineDeadError("engine loop died"), 503, "service_unavailable"),
    (lambda rid: RuntimeError("boom: a bug"), 500, "internal_error"),
    (lambda rid: final(rid, error="denoise failed: RuntimeError: nan"), 500, "internal_error"),
])
def test_engine_faults_are_openai_errors(behaviour, status, code):
    got, headers, body = call(behaviour)
    assert got == status and body["error"]["code"] == code
    assert "Traceback" not in body["error"]["message"] and "boom" not in body["error"]["message"]
    if status == 429:
        assert headers["retry-after"] == "1"
    if status == 500:
        assert "request id img-" in body["error"]["message"]  # to find the logged traceback


def test_short_field_names_are_documented_aliases_and_both_at_once_is_400():
    """`dvllm generate`'s "steps" and "guidance" mean num_inference_steps and guidance_scale over HTTP too
    (they were ignored as unknown fields: the request ran the model's default steps)."""
    seen = []
    engine = StubEngine(lambda rid: final(rid))
    real = engine.generate

    def recording(prompt, params=None, request_id=None):
        seen.append(params)
        return real(prompt, params, request_id)

    engine.generate = recording
    with TestClient(build_app(engine, argparse.Namespace()), raise_server_exceptions=False) as client:
        ok = client.post("/v1/images/generations", json={"prompt": "x", "steps": 2, "guidance": 3.5,
                                                         "aesthetic_score": 7, "negative_aesthetic_score": 1.5})
        both = client.post("/v1/images/generations", json={"prompt": "x", "steps": 2, "num_inference_steps": 3})
    assert ok.status_code == 200
    assert (seen[0].num_inference_steps, seen[0].guidance_scale) == (2, 3.5)
    assert (seen[0].aesthetic_score, seen[0].negative_aesthetic_score) == (7, 1.5)  # (the refiner's fields)
    assert both.status_code == 400 and len(seen) == 1
    assert "'steps' is short for 'num_inference_steps'" in both.json()["error"]["message"]
