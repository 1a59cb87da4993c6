"""Benchmark traces with ControlNet controls (`dvllm bench trace loras --controls SHARE`, control_inputs.py): the
share asked for carries controls, a smaller share two, the images are made from seeds; the requests are the trace's
without controls plus theirs; read back, the controls reach the engine's SamplingParams and the HTTP body; and the
harness replays such a trace on an engine with random controlnets."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dvllm.benchmarks import traces
from dvllm.benchmarks.control_inputs import control_image
from dvllm.benchmarks.harness import check_contenders, params_of
from dvllm.benchmarks.workloads import trace_workload
from test_bench_harness import _args


def test_a_share_of_the_requests_carries_one_or_two_controls_and_nothing_else_changes():
    plain = traces.generate("loras", 400, 2.0, seed=3, size_divisor=8)
    lines = traces.generate("loras", 400, 2.0, seed=3, size_divisor=8, control_share=0.4)
    assert lines == traces.generate("loras", 400, 2.0, seed=3, size_divisor=8, control_share=0.4)  # seeded
    assert [{k: v for k, v in line.items() if k != "controls"} for line in lines] == plain
    counts = [len(line.get("controls", ())) for line in lines]
    assert 0.33 < sum(c > 0 for c in counts) / 400 < 0.47 and 0.05 < counts.count(2) / 400 < 0.15
    for line in lines:
        names = [c["name"] for c in line.get("controls", ())]
        assert set(names) <= {"control0", "control1"} and len(set(names)) == len(names)
        for c in line.get("controls", ()):
            assert 0.5 <= c["scale"] <= 1.0 and c["start"] == 0.0 and c["end"] in (0.8, 1.0)
    with pytest.raises(ValueError, match="controls: for the image traces"):
        traces.generate("video", 2, 1.0, control_share=0.5)
    with pytest.raises(ValueError, match=r"controls: a share in \[0, 1\]"):
        traces.generate("images", 2, 1.0, control_share=1.5)


def test_read_back_the_controls_reach_the_engines_params_and_the_http_body(tmp_path):
    lines = traces.generate("images", 30, math.inf, seed=1, size_divisor=8, control_share=1.0)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    specs = trace_workload(str(path), size="32x32", steps=2, guidance=5.0, sampler=None)
    spec = next(s for s in specs if len(s.controls) == 2)
    width, height = (int(v) for v in spec.size.split("x"))
    params = params_of(spec)
    assert [c["name"] for c in params.controls] == [c["name"] for c in spec.controls]
    for control, wanted in zip(params.controls, spec.controls):
        assert control["image"].shape == (height, width, 3) and control["image"].dtype == np.uint8
        assert np.array_equal(control["image"], control_image(width, height, wanted["image_seed"]))
        assert control["image"].any() and not control["image"].all()  # outlines on black
    body = spec.body()["controls"]
    assert [c["scale"] for c in body] == [c["scale"] for c in spec.controls]
    assert all(c["image"].startswith("data:image/png;base64,") for c in body)
    with pytest.raises(ValueError, match="the pipeline contenders .* take no controls"):
        check_contenders(["dvllm", "serial"], specs)


@pytest.mark.slow
def test_the_harness_replays_a_trace_with_controls_on_random_controlnets(sd_eps_path, tmp_path):
    from dvllm.benchmarks.harness import main

    out = tmp_path / "run.json"
    assert main(_args("--model", sd_eps_path, "--device", "cpu", "--dtype", "float32", "--generate", "images",
                      "--num", "2", "--rate", "inf", "--size-divisor", "8", "--clamp-steps", "1", "--controls", "1",
                      "--random-controlnets", "--contenders", "dvllm", "--max-image-pixels", str(128 * 128),
                      "--output-json", str(out))) == 0
    result = json.loads(out.read_text())
    (s,) = result["runs"][0]["contenders"]["dvllm"]
    assert (s["completed"], s["failed"]) == (2, 0), s["errors"]
