"""dvllm.benchmarks.video_workload on the tiny Wan pipeline: every engine makes every video, and the report holds
what it says (no timing is asserted: the figures are the benchmark's, on a real machine)."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from dvllm.benchmarks import video_workload

ENGINES = ("serial", "static", "dvllm")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    video_workload.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_workload_is_seeded_and_draws_from_the_choices():
    draw = dict(sizes=["256x256", "320x192"], frames=[9, 17, 33], steps=[4, 10], guidances=[1.0, 5.0], rate=2.0)
    requests = video_workload.mixed_workload(20, seed=1, **draw)
    assert requests == video_workload.mixed_workload(20, seed=1, **draw)
    assert requests != video_workload.mixed_workload(20, seed=2, **draw)
    assert {(r.width, r.height) for r in requests} == {(256, 256), (320, 192)}
    assert {r.frames for r in requests} <= {9, 17, 33} and {r.steps for r in requests} <= {4, 10}
    arrivals = [r.arrival for r in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert len({r.prompt for r in requests}) == 20  # no prompt cache advantage

    behind = video_workload.behind_long_workload(2, 0.5, size="320x192", frames=[9, 33], steps=[4, 10],
                                                 guidance=5.0)
    long, *shorts = behind
    assert (long.frames, long.steps, long.arrival, long.width, long.height) == (33, 10, 0.0, 320, 192)
    assert [(s.frames, s.steps, s.arrival) for s in shorts] == [(9, 4, 0.5), (9, 4, 1.0)]


def test_each_round_starts_with_another_engine():
    orders = [video_workload.engine_order(r) for r in range(4)]
    assert orders[:3] == [("serial", "static", "dvllm"), ("static", "dvllm", "serial"), ("dvllm", "serial", "static")]
    assert orders[3] == orders[0]


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "--num-requests"),
    (["--sizes", "256"], "WIDTHxHEIGHT"),
    (["--frames", "a,b"], "--frames"),
    (["--rounds", "0"], "--rounds"),
    (["--shorts", "0"], "--shorts"),
])
def test_bad_arguments_are_value_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        video_workload.run(parse(*argv))


def test_every_engine_makes_every_video_and_the_report_says_so(wan_path, tmp_path, capsys):
    out = tmp_path / "video.json"
    video_workload.main(["--model", wan_path, "--load-format", "auto", "--sizes", "16x16,32x16", "--frames", "5,9",
                         "--steps", "2,3", "--num-requests", "4", "--shorts", "2", "--short-gap-s", "0.05",
                         "--max-batch-size", "4", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert "dvllm/serial" in printed and "dvllm/static" in printed and "behind a long clip" in printed
    result = json.loads(out.read_text())
    mixed, behind = result["mixed"], result["behind_long"]
    assert result["engine_order"] == [list(ENGINES)]
    assert len(mixed["requests"]) == 4 and len(behind["requests"]) == 3
    frames = sum(r["frames"] for r in mixed["requests"])
    for name in ENGINES:
        summary = mixed[name]
        # a run raises unless each request's one video came with its frames and size
        assert (summary["videos"], summary["frames"]) == (4, frames)
        (round_,) = summary["rounds"]
        assert len(round_["latencies_s"]) == 4 and all(t > 0 for t in round_["latencies_s"])
        assert summary["frames_per_s"] == pytest.approx(summary["videos_per_s"] * frames / 4)
        assert 0 < summary["latency_p50_s"] <= summary["latency_p95_s"]
        assert len(behind[name]["rounds"][0]["latencies_s"]) == 3
        assert behind[name]["short_latency_p50_s"] <= behind[name]["short_latency_max_s"]
    for pair in ("dvllm/serial", "dvllm/static"):
        assert set(mixed["ratios"][pair]) == {"videos_per_s", "frames_per_s", "latency_p50_s", "latency_p95_s"}
        assert set(behind["ratios"][pair]) == {"short_latency_p50_s", "short_latency_max_s", "long_latency_s"}
        assert all(math.isfinite(v) and v > 0 for v in mixed["ratios"][pair].values())
    assert mixed["ratios"]["dvllm/serial"]["videos_per_s"] == pytest.approx(
        mixed["dvllm"]["videos_per_s"] / mixed["serial"]["videos_per_s"])



@pytest.mark.slow
def test_the_pixel_bound_reaches_dvllms_engine(wan_path, tmp_path, capsys, monkeypatch):
    """The scheduler's tests (test_running_pixels.py) check what the bound does; here, that the run passes it on
    and every video still comes."""
    made = []

    class Recorded(video_workload.AsyncDiffusionEngine):
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(video_workload, "AsyncDiffusionEngine", Recorded)
    out = tmp_path / "video.json"
    video_workload.main(["--model", wan_path, "--load-format", "auto", "--sizes", "16x16,32x16", "--frames", "5,9",
                         "--steps", "2,3", "--num-requests", "4", "--shorts", "1", "--max-running-pixels", "1",
                         "--output-json", str(out)])
    assert "max_running_pixels 1" in capsys.readouterr().out
    assert [kwargs["max_running_pixels"] for kwargs in made] == [1]
    result = json.loads(out.read_text())
    assert result["args"]["max_running_pixels"] == 1 and result["mixed"]["dvllm"]["videos"] == 4
