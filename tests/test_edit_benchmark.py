"""The edit workload of `dvllm bench serve`: deterministic multipart requests, and a tiny end-to-end run against
`dvllm serve` of a tiny Qwen-Image-Edit Plus (one or two input images)."""
from __future__ import annotations

import io
import json

import pytest
from PIL import Image
from test_benchmarks import ENGINE_ARGS
from utils_server import RemoteServer

from dvllm.benchmarks.workloads import edit_image_png, edit_workload
from dvllm.entrypoints.cli import main as dvllm_main

EDIT = dict(size="32x32", image_sizes=["48x64", "64x64", "80x48"], images_per_request=[1, 2], steps=[2, 3],
            guidances=[1.0, 4.0])


def test_edit_workload_is_seeded_multipart():
    a, b = edit_workload(24, seed=3, **EDIT), edit_workload(24, seed=3, **EDIT)
    assert a == b and [s.files() for s in a] == [s.files() for s in b]  # same specs, same PNG bytes
    assert a != edit_workload(24, seed=4, **EDIT)
    assert {len(s.images) for s in a} == {1, 2} and {s.steps for s in a} == {2, 3}
    assert {(w, h) for s in a for w, h, _ in s.images} == {(48, 64), (64, 64), (80, 48)}
    for spec in a:
        assert spec.endpoint == "/v1/images/edits"
        assert (spec.negative_prompt is not None) == (spec.guidance > 1)
        form, files = spec.form(), spec.files()
        assert form["size"] == "32x32" and form["num_inference_steps"] == str(spec.steps)
        assert form["response_format"] == "b64_json" and ("negative_prompt" in form) == (spec.guidance > 1)
        assert [f[0] for f in files] == (["image"] if len(spec.images) == 1 else ["image[]"] * 2)
        for (_, (_, png, mime)), (w, h, _) in zip(files, spec.images):
            with Image.open(io.BytesIO(png)) as image:
                assert mime == "image/png" and image.size == (w, h) and image.mode == "RGB"
    assert edit_image_png(48, 64, 1) != edit_image_png(48, 64, 2)


def _bench(url: str, out, label: str) -> dict:
    args = ["bench", "serve", "--base-url", url, "--label", label, "--output-json", str(out), "--workload", "edit",
            "--size", "32x32", "--edit-images", "1,2", "--mix-steps", "2,3", "--mix-guidance", "1.0,4.0",
            "--num-requests", "4", "--request-rate", "20", "--warmup", "1", "--seed", "5"]
    assert dvllm_main(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_edit_bench_end_to_end(qwen_image_edit_plus_path, tmp_path):
    """Two runs of the edit workload against one server send the same requests at the same offsets."""
    with RemoteServer(qwen_image_edit_plus_path, ENGINE_ARGS) as dvllm:
        first = _bench(dvllm.url, tmp_path / "first.json", "first")
        second = _bench(dvllm.url, tmp_path / "second.json", "second")
    for result in (first, second):
        s = result["summary"]
        assert (s["num_requests"], s["completed"], s["failed"]) == (4, 4, 0), s["errors"]
    assert [r["arrival"] for r in first["requests"]] == [r["arrival"] for r in second["requests"]]
    assert [r["seeds"] for r in first["requests"]] == [r["seeds"] for r in second["requests"]]
