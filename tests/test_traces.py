"""`dvllm bench trace`: production-shaped traces, seeded, with the shapes their docstring promises, written as
JSONL that the serving benchmark's trace reader takes back line for line."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from utils_cli import restore_logging  # noqa: F401 (autouse: main() sets the process's logging; put back)

from dvllm.benchmarks.traces import generate, zipf_weights
from dvllm.benchmarks.workloads import trace_workload
from dvllm.entrypoints.cli import main as dvllm_main


def test_the_images_trace_is_seeded_and_mostly_at_the_bots_defaults():
    lines = generate("images", 2000, 4.0, seed=3)
    assert lines == generate("images", 2000, 4.0, seed=3) and lines != generate("images", 2000, 4.0, seed=4)
    sizes, steps = Counter(line["size"] for line in lines), Counter(line["steps"] for line in lines)
    assert sizes.most_common(1)[0][0] == "512x512" and 0.45 < sizes["512x512"] / 2000 < 0.65
    assert {"1024x576", "576x1024", "1024x1024"} <= set(sizes) and steps.most_common(1)[0][0] == 50
    assert min(steps) == 4 and max(steps) == 50
    arrivals = [line["arrival"] for line in lines]
    assert arrivals == sorted(arrivals) and 2000 / arrivals[-1] == pytest.approx(4.0, rel=0.1)  # Poisson at 4/s
    assert not any("loras" in line or "cache" in line for line in lines)


def test_the_lora_trace_has_zero_to_three_adapters_with_skewed_popularity():
    lines = generate("loras", 3000, float("inf"), lora_pool=32)
    counts = Counter(len(line.get("loras", {})) for line in lines)
    assert set(counts) == {0, 1, 2, 3} and counts[0] > counts[1] > counts[2] > counts[3]
    popularity = Counter(name for line in lines for name in line.get("loras", {}))
    assert popularity["lora00"] > 5 * popularity["lora19"] > 0  # a few in most requests, most rare
    assert all(0.4 <= w <= 1.0 for line in lines for w in line.get("loras", {}).values())
    assert all(line["arrival"] == 0.0 for line in lines)
    assert zipf_weights(3, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])


def test_the_cache_trace_caches_its_share_each_at_its_own_setting():
    lines = generate("cache", 2000, 1.0, cache_share=0.3)
    cached = [line["cache"] for line in lines if "cache" in line]
    assert 0.25 < len(cached) / 2000 < 0.35
    assert {c["method"] for c in cached} == {"first_block", "taylorseer"} and len({json.dumps(c) for c in cached}) > 4


def test_the_video_trace_is_wans_sizes_and_frames_and_bench_serve_leaves_it_to_bench_run(tmp_path):
    lines = generate("video", 1000, 0.2, seed=1)
    sizes, frames = Counter(line["size"] for line in lines), Counter(line["frames"] for line in lines)
    assert set(sizes) == {"832x480", "480x832", "480x480"} and sizes.most_common(1)[0][0] == "832x480"
    assert set(frames) == {17, 33, 49, 81} and frames.most_common(1)[0][0] == 81
    assert {(line["steps"], line["guidance"]) for line in lines} == {(50, 5.0), (30, 5.0), (20, 6.0), (4, 1.0)}
    tiny = generate("video", 50, 0.2, seed=1, size_divisor=26)  # to Wan's patch: multiples of 16
    assert {line["size"] for line in tiny} == {"32x16", "16x32", "16x16"}
    trace = tmp_path / "video.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in tiny))
    specs = trace_workload(str(trace), size="16x16", steps=2, guidance=1.0, sampler=None)
    assert [s.frames for s in specs] == [line["frames"] for line in tiny]
    import argparse

    from dvllm.benchmarks.serving import add_cli_args, build_workload

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(ValueError, match="a video trace .frames.: replay it in process with `dvllm bench run`"):
        build_workload(parser.parse_args(["--workload", "trace", "--trace", str(trace)]))


def test_written_traces_replay_line_for_line_at_a_tiny_models_size(tmp_path, capsys):
    out = tmp_path / "loras.jsonl"
    assert dvllm_main(["bench", "trace", "loras", "--num", "50", "--rate", "2", "--size-divisor", "8",
                       "--lora-pool", "4", "-o", str(out)]) == 0
    assert "50 requests written" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    specs = trace_workload(str(out), size="16x16", steps=1, guidance=1.0, sampler=None)
    assert [(s.prompt, s.size, s.steps, s.seed, s.loras) for s in specs] == \
        [(line["prompt"], line["size"], line["steps"], line["seed"], line.get("loras")) for line in lines]
    assert {s.size for s in specs} <= {"64x64", "96x96", "128x128", "64x96", "96x64", "72x128", "128x72"}


def test_the_throughput_and_stall_traces():
    uniform = generate("uniform", 6, float("inf"), size_divisor=32)
    assert {(line["size"], line["steps"], line["guidance"], line["arrival"]) for line in uniform} == \
        {("16x16", 20, 7.5, 0.0)}
    mixed = generate("mixed", 40, 1.0, size_divisor=32)
    assert {line["size"] for line in mixed} == {"16x16", "32x32"} and {line["guidance"] for line in mixed} == {7.5, 1.0}
    assert {line["steps"] for line in mixed} == {10, 20, 30} and mixed == generate("mixed", 40, 1.0, size_divisor=32)
    stall = generate("stall", 8, 4.0, size_divisor=16)
    runners, burst = stall[:2], stall[2:]  # a quarter run on; the rest arrive together 1/rate s later
    assert all(line["arrival"] == 0.0 and line["steps"] == 50 for line in runners)
    assert all(line["arrival"] == 0.25 and line["steps"] == 20 and line["negative_prompt"] for line in burst)
    assert len({line["prompt"] for line in burst}) == len(burst)  # every text new: every one is encoded
    assert all(line["arrival"] == 0.0 for line in generate("stall", 8, float("inf")))
    with pytest.raises(ValueError, match="size_divisor must divide the sizes"):
        generate("uniform", 2, 1.0, size_divisor=128)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "audio"}, "kind must be one of"),
    ({"num": 0}, "num must be at least 1"),
    ({"size_divisor": 16}, "size_divisor must divide the sizes"),
    ({"cache_share": 1.5}, r"cache_share in \[0, 1\]"),
])
def test_bad_trace_arguments_are_refused(kwargs, message):
    args = {"kind": "images", "num": 10, "rate": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(args.pop("kind"), args.pop("num"), args.pop("rate"), **args)
