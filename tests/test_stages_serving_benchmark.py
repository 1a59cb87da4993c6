"""dvllm.benchmarks.stages_serving end to end, tiny: two real servers of the tiny-sd preset, decode stage off
and on, a few streaming requests each."""
from __future__ import annotations

import json

import pytest

from dvllm.benchmarks import stages_serving

# One request per forward (its CFG rows fill the batch) and one image per decode: the images' float noise
# then does not depend on which requests happened to share a batch, so the two servers' pixels must be equal.
SERVER_ARGS = "--device cpu --dtype float32 --state-pool-mb 32 --max-batch-size 2 --max-decode-batch 1"


@pytest.mark.slow
def test_stages_serving_benchmark_end_to_end(tmp_path):
    out = tmp_path / "stages.json"
    # tiny-sd (random weights) starts in half the built-in model's time; the benchmark's default is the latter.
    rc = stages_serving.main(["--model", "tiny-sd", "--num-requests", "3", "--request-rate", "4", "--steps", "3",
                              "--size", "16x16", "--partial-images", "1", "--rounds", "1", "--warmup", "0",
                              "--server-args", SERVER_ARGS, "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["settings"]) == {"off", "on"}
    for summary in result["settings"].values():
        assert (summary["completed"], summary["failed"], summary["runs"]) == (3, 0, 1)
        assert summary["images_per_s"] > 0
    requests = result["requests"]
    assert sorted((r["setting"], r["index"]) for r in requests) == [(s, i) for s in ("off", "on") for i in range(3)]
    for r in requests:
        assert r["ok"] and r["error"] is None and r["partials"] == 1, r
        assert 0 < r["ttfs"] <= r["first_partial"] <= r["latency"], r
    assert result["images"]["images_equal"] and result["images"]["requests_pixel_equal"] == 3
    assert set(result["ratios_on_off"]) >= {"images_per_s", "latency_p95_s", "ttfs_p95_s"}
    # The stage's counters came from /metrics: the on server decoded on its stage, the off server in its loop.
    assert result["settings"]["on"]["stages"]["decode_stage"]["items"] > 0
    assert result["settings"]["off"]["stages"].get("decode_stage", {}).get("items", 0) == 0


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--request-rate", "inf"], ["--request-rate", "0"],
                                  ["--steps", "2", "--partial-images", "2"], ["--size", "64"], ["--rounds", "0"]])
def test_stages_serving_refuses_bad_arguments(argv):
    args = stages_serving.build_parser().parse_args(argv)
    with pytest.raises(ValueError):
        stages_serving.check_args(args)
