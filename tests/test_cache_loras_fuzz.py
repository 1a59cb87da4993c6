"""`cache` and `loras` as a hostile client sends them: any JSON value, in a JSON body or as a multipart
form's JSON text, to either images endpoint, for a UNet model and for a transformer that serves step
caching. Each answer is a 200 or a 400 in OpenAI's error shape, never a 500."""
from __future__ import annotations

import argparse
import io
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.sampling_params import SamplingParams
from dvllm.step_cache import _DEFAULT_ONLY, _FIELDS, MAX_CACHE_STEP, METHODS

FORM = {"prompt": "x", "num_inference_steps": "2", "size": "16x16"}  # img2img at strength 0.8 runs 1 step
BODY = {"prompt": "x", "num_inference_steps": 2, "size": "16x16"}
BIG = "9" * 400  # too large for a float: float() raises OverflowError
VALID_BASE = {"first_block": {}, "taylorseer": {}, "mag": {"mag_ratios": [1.0, 0.9]}, "teacache": {}}


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(out, format="PNG")
    return out.getvalue()


PNG = _png()


@pytest.fixture(scope="module")
def clients(sd_eps_path, flux_path):
    """A UNet model (no step caching, img2img) and a transformer (step caching, no img2img), LoRA on."""
    out = {}
    with (_client(sd_eps_path) as unet, _client(flux_path) as dit):
        out["unet"], out["dit"] = unet, dit
        yield out


def _client(path: str) -> TestClient:
    engine = AsyncDiffusionEngine(model=path, device="cpu", dtype="float32", state_pool_mb=16, enable_lora=True)
    return TestClient(build_app(engine, argparse.Namespace(served_model_name="tiny")), raise_server_exceptions=False)


def send(client: TestClient, endpoint: str, field: str, text: str):
    """`text` as the JSON of `field`: inside the JSON body, or as the form field's text."""
    if endpoint == "generations":
        body = json.dumps(BODY).rstrip("}") + f", {json.dumps(field)}: {text}}}"
        return client.post("/v1/images/generations", content=body, headers={"Content-Type": "application/json"})
    return client.post("/v1/images/edits", data={**FORM, field: text},
                       files={"image": ("in.png", PNG, "image/png")})


def assert_200_or_400(response) -> dict[str, Any] | None:
    assert response.status_code in (200, 400), (response.status_code, response.text[:2000])
    if response.status_code == 200:
        assert len(response.json()["data"]) == 1
        return None
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert isinstance(error["message"], str) and len(error["message"]) <= 500, error["message"][:2000]
    return error


# -- the reported inputs ------------------------------------------------------------------------------------

REPORTED = {
    "dtype-list": '{"method": "taylorseer", "taylor_factors_dtype": []}',
    "dtype-object": '{"method": "taylorseer", "taylor_factors_dtype": {}}',
    "huge-threshold": '{"method": "first_block", "threshold": ' + BIG + "}",
    "huge-mag-ratio": '{"method": "mag", "mag_ratios": [' + BIG + "]}",
    "huge-mag-threshold": '{"method": "mag", "mag_ratios": [1.0], "threshold": ' + BIG + "}",
    "huge-retention": '{"method": "mag", "mag_ratios": [1.0], "retention_ratio": ' + BIG + "}",
    "huge-after-step": '{"method": "taylorseer", "disable_cache_after_step": ' + BIG + "}",
    "huge-before-step": '{"method": "taylorseer", "disable_cache_before_step": ' + BIG + "}",
    "huge-skip-steps": '{"method": "mag", "mag_ratios": [1.0], "max_skip_steps": ' + BIG + "}",
    "surrogate-key": '{"method": "first_block", "\\ud800": 1}',
    "surrogate-mag-ratios": '{"method": "mag", "mag_ratios": "\\ud800"}',
    "surrogate-method": '{"method": "\\udfff"}',
}


@pytest.mark.parametrize("model", ["unet", "dit"])
@pytest.mark.parametrize("endpoint", ["generations", "edits"])
@pytest.mark.parametrize("text", REPORTED.values(), ids=REPORTED.keys())
def test_reported_cache_values_are_400s_naming_cache(clients, model, endpoint, text):
    error = assert_200_or_400(send(clients[model], endpoint, "cache", text))
    assert error is not None and error["param"] == "cache", error
    assert error["message"].startswith("cache"), error


EDGES = [  # every number at the end of its range: served, through the worker
    {"method": "first_block", "threshold": 1e308},
    {"method": "taylorseer", "cache_interval": 1000, "disable_cache_before_step": MAX_CACHE_STEP,
     "disable_cache_after_step": MAX_CACHE_STEP, "max_order": 4, "taylor_factors_dtype": "float32"},
    {"method": "taylorseer", "cache_interval": 1, "disable_cache_before_step": 0, "disable_cache_after_step": 0,
     "max_order": 0},
    {"method": "mag", "mag_ratios": [1e308, 5e-324], "threshold": 0, "max_skip_steps": MAX_CACHE_STEP,
     "retention_ratio": 1, "num_inference_steps": 1000},
]


@pytest.mark.parametrize("cache", EDGES, ids=[c["method"] for c in EDGES])
def test_cache_values_at_their_bounds_are_served(clients, cache):
    response = send(clients["dit"], "generations", "cache", json.dumps(cache))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("method, field", [("taylorseer", "disable_cache_before_step"),
                                           ("taylorseer", "disable_cache_after_step"), ("mag", "max_skip_steps")])
def test_step_fields_past_their_bound_say_it(clients, method, field):
    cache = {"method": method, **VALID_BASE[method], field: MAX_CACHE_STEP + 1}
    error = assert_200_or_400(send(clients["dit"], "generations", "cache", json.dumps(cache)))
    assert error["param"] == "cache" and f"cache.{field}" in error["message"], error
    assert str(MAX_CACHE_STEP) in error["message"], error


def test_a_long_value_is_not_echoed_whole(clients):
    text = json.dumps({"method": "taylorseer", "taylor_factors_dtype": "x" * 1_000_000})
    error = assert_200_or_400(send(clients["dit"], "generations", "cache", text))
    assert error["param"] == "cache" and len(error["message"]) < 500, error["message"][:500]


EDIT_FORM_JUNK = {
    "nan": '{"method": "first_block", "threshold": NaN}',
    "infinity": '{"method": "first_block", "threshold": Infinity}',
    "bare-nan": "NaN",
    "deep": "[" * 100_000,
    "5000-digits": "9" * 5000,  # past Python's int-from-text limit: a ValueError, not a JSONDecodeError
    "list": "[]",
    "string": '"first_block"',
}


@pytest.mark.parametrize("field", ["cache", "loras"])
@pytest.mark.parametrize("text", EDIT_FORM_JUNK.values(), ids=EDIT_FORM_JUNK.keys())
def test_edits_json_form_fields_refuse_junk_with_a_400(clients, field, text):
    error = assert_200_or_400(send(clients["unet"], "edits", field, text))
    assert error is not None and error["param"] == field, error


LORA_JUNK = {
    "many-names": json.dumps({f"a{i}": 1.0 for i in range(50_000)}),  # within the 1 MB body limit
    "bad-name": '{"a b": 1.0}',
    "long-name": json.dumps({"a" * 129: 1.0}),
    "newline-name": '{"a\\n": 1.0}',
    "surrogate-name": '{"\\ud800": 1.0}',
    "huge-weight": '{"a": ' + BIG + "}",
    "list-weight": '{"a": []}',
}


@pytest.mark.parametrize("endpoint", ["generations", "edits"])
@pytest.mark.parametrize("text", LORA_JUNK.values(), ids=LORA_JUNK.keys())
def test_bad_loras_are_400s_naming_loras(clients, endpoint, text):
    error = assert_200_or_400(send(clients["unet"], endpoint, "loras", text))
    assert error is not None and error["param"] == "loras" and error["message"].startswith("loras"), error
    assert len(error["message"]) < 500, error["message"][:500]


@pytest.mark.parametrize("params", [
    dict(cache={1: "first_block"}), dict(cache={"method": "first_block", ("x",): 1}),
    dict(cache={"method": "first_block", "threshold": 10 ** 5000}),  # past str()'s 4300 digits
    dict(cache={"method": "mag", "mag_ratios": [10 ** 5000]}), dict(loras={1: 1.0}),
    dict(loras={"a": 10 ** 5000}), dict(loras={"x" * 10 ** 6: 1.0}),
], ids=["int-key", "tuple-key", "5000-digit-threshold", "5000-digit-ratio", "int-name", "5000-digit-weight",
        "long-name"])
def test_python_callers_get_bounded_value_errors(params):
    """The Python API takes what JSON cannot carry: keys that are not strings, integers too long to print."""
    with pytest.raises(ValueError, match=r"^(cache|loras)") as error:
        SamplingParams(**params).validate()
    assert len(str(error.value)) < 500
    str(error.value).encode("utf-8")  # raises on a lone surrogate: the server could not send it


# -- any JSON value -----------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(10 ** 400), 10 ** 400)
           | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0, 1, 3, 0.05, 1e308, -0.0])
           | st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "flux", "bfloat16", *METHODS]))
JSON_VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=8) | st.sampled_from(["method", "\ud800"]), children,
                                             max_size=4), max_leaves=8)
TARGETS = st.tuples(st.sampled_from(["unet", "dit"]), st.sampled_from(["generations", "edits"]))
# A method, and some of its fields (and of the fields it takes at their defaults only, and one it has not)
# with any values, over a base that is valid.
CACHES = st.sampled_from(METHODS).flatmap(lambda method: st.builds(
    lambda fields: {"method": method, **VALID_BASE[method], **fields},
    st.dictionaries(st.sampled_from([*_FIELDS[method], *_DEFAULT_ONLY.get(method, ()), "x"]), JSON_VALUES,
                    min_size=1, max_size=3)))
# Requests that pass run the model (2 steps at 16x16): most examples here are refused in microseconds.
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(target=TARGETS, value=JSON_VALUES)
def test_any_json_as_cache_is_200_or_400(clients, target, value):
    model, endpoint = target
    assert_200_or_400(send(clients[model], endpoint, "cache", json.dumps(value, ensure_ascii=True)))


@FUZZ
@given(target=TARGETS, cache=CACHES)
def test_any_json_in_cache_fields_is_200_or_400(clients, target, cache):
    model, endpoint = target
    assert_200_or_400(send(clients[model], endpoint, "cache", json.dumps(cache, ensure_ascii=True)))


@FUZZ
@given(target=TARGETS, loras=JSON_VALUES | st.dictionaries(st.text(max_size=10) | st.just("a\ud800"), JSON_VALUES,
                                                              max_size=3))
def test_any_json_as_loras_is_200_or_400(clients, target, loras):
    model, endpoint = target
    assert_200_or_400(send(clients[model], endpoint, "loras", json.dumps(loras, ensure_ascii=True)))
