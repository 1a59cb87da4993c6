"""`dvllm bench run`: one trace replayed in process against dvllm, its request-level policy and the serial pipeline,
each request's SLO a multiple of its kind's solo latency; what the harness refuses, it says before loading."""
from __future__ import annotations

import argparse
import json

import pytest
from PIL import Image

from dvllm.benchmarks.harness import add_arguments, check_contenders, main, variants_of
from dvllm.benchmarks.workloads import trace_workload


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_a_trace_replays_against_the_three_contenders(sd_eps_path, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [{"prompt": f"p{i}", "size": size, "steps": steps, "guidance": guidance, "seed": i, "arrival": 0.05 * i}
             for i, (size, steps, guidance) in enumerate([("16x16", 3, 5.0), ("32x32", 2, 5.0), ("16x16", 3, 5.0),
                                                           ("16x16", 4, 1.0), ("32x32", 2, 5.0), ("16x16", 3, 5.0)])]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run.json"
    assert main(_args("--model", sd_eps_path, "--device", "cpu", "--dtype", "float32", "--trace", str(trace),
                      "--rounds", "2", "--slo-factor", "1000", "--output-json", str(out))) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 6 and result["solo_kinds"] == 3  # (16x16, 3, CFG), (32x32, 2, CFG), (16x16, 4)
    (run,) = result["runs"]
    assert run["rate"] is None and list(run["contenders"]) == ["dvllm", "request", "serial"]
    for name, summaries in run["contenders"].items():
        assert len(summaries) == 2, name
        for s in summaries:
            assert (s["completed"], s["failed"]) == (6, 0), (name, s["errors"])
            assert s["latency_p50_s"] <= s["latency_p99_s"] and 0 < s["first_step_p50_s"] <= s["latency_p99_s"]
            assert s["slo_attainment"] == 1.0  # 1000x solo: every request in bound, whoever runs it
            assert len(s["latencies"]) == 6 and s["latencies"] == sorted(s["latencies"])
            assert all(0 < share < 1 for share in s["slo_shares"])
            # admitted to done is the request's time but its wait: no longer than the whole
            assert 0 <= s["queue_p50_s"] and 0 < s["service_p50_s"] <= s["latencies"][-1]
    printed = capsys.readouterr().out
    assert "SLO 1000x solo latency (3 kinds measured alone), 2 round(s)" in printed


@pytest.mark.slow
def test_a_generated_lora_trace_at_two_rates_is_the_same_requests_and_plots(sd_eps_path, tmp_path):
    """Random adapters for the trace's LoRA names, served by the engines and by the serial pipeline alike."""
    pytest.importorskip("matplotlib")
    out, figures = tmp_path / "run.json", tmp_path / "figs"
    assert main(_args("--model", sd_eps_path, "--device", "cpu", "--dtype", "float32", "--generate", "loras",
                      "--num", "2", "--rate", "8,inf", "--size-divisor", "8", "--random-loras", "4",
                      "--max-image-pixels", str(128 * 128), "--trace-seed", "1",
                      "--output-json", str(out), "--plot-dir", str(figures))) == 0
    result = json.loads(out.read_text())
    assert [run["rate"] for run in result["runs"]] == [8.0, "inf"]
    for run in result["runs"]:
        assert list(run["contenders"]) == ["dvllm", "request", "serial"]
        for name, (s,) in run["contenders"].items():
            assert (s["completed"], s["failed"]) == (2, 0), (name, s["errors"])
    for name in ("latency_cdf.png", "goodput_vs_load.png"):
        with Image.open(figures / name) as image:
            assert image.width > 300 and image.height > 200


def test_what_the_harness_refuses_it_names(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": "x", "loras": {"style": 1.0}}) + "\n")
    specs = trace_workload(str(trace), size="16x16", steps=2, guidance=1.0, sampler=None)
    with pytest.raises(ValueError, match="a comma list of"):
        check_contenders(["dvllm", "turbo"], specs)
    with pytest.raises(ValueError, match="a comma list of"):
        check_contenders(["dvllm", "dvllm"], specs)
    variants = variants_of(["oldest:shape_order=oldest", "small:max_batch_size=4,decode_stage=false"])
    assert variants == {"oldest": {"shape_order": "oldest"}, "small": {"max_batch_size": 4, "decode_stage": False}}
    check_contenders(["small", "serial"], specs, variants)
    for bad in ("dvllm:max_batch_size=4", "x", "x:", "x:max_batch_size", "oldest:a=1"):
        with pytest.raises(ValueError, match="--engine-variant: LABEL:KEY=VALUE"):
            variants_of(["oldest:shape_order=oldest", bad])
    with pytest.raises(ValueError, match="give --trace FILE or --generate KIND"):
        main(_args("--model", "tiny-sd"))
    with pytest.raises(ValueError, match="--rate and --clamp-. are for --generate"):
        main(_args("--model", "tiny-sd", "--trace", str(trace), "--rate", "2"))
    for bad in ("0", "1,1", "x", "2,-1"):
        with pytest.raises(ValueError, match="--rate: positive requests/s"):
            main(_args("--model", "tiny-sd", "--generate", "images", "--rate", bad))
    with pytest.raises(ValueError, match="solo latencies are measured on one"):
        main(_args("--model", "tiny-sd", "--load-format", "dummy", "--device", "cpu", "--generate", "images",
                   "--num", "2", "--contenders", "serial"))


@pytest.mark.slow
def test_the_serial_baseline_runs_each_requests_loras_as_the_engine_does(sd_eps_path, tmp_path):
    """diffusers' way (load_lora_weights once, set_adapters per call, LoRA off for a request with none) gives the
    engine's image for each request, whatever the request before it used."""
    import asyncio

    import numpy as np
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    from dvllm import DiffusionEngine, SamplingParams
    from dvllm.benchmarks.baselines.runner import Job, PipelineRunner

    adapters = {"style": make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=5),
                "ink": make_lora(tiny_sd_pipeline(), str(tmp_path / "ink"), seed=6)}
    runner = PipelineRunner(sd_eps_path, device="cpu", dtype="float32", lora_modules=adapters)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules=adapters)
    loop = asyncio.new_event_loop()
    try:
        for i, loras in enumerate([{"style": 0.7}, {"style": 0.3, "ink": -0.5}, None]):
            params = SamplingParams(num_inference_steps=3, height=16, width=16, seed=i, loras=loras)
            (image,) = runner.run([Job("a cat", runner.resolve(params), loop.create_future())])[0]
            want = engine.generate("a cat", params, use_tqdm=False)[0].images[0]
            diff = np.abs(np.asarray(image, dtype=np.int16) - np.asarray(want, dtype=np.int16))
            assert diff.max() <= 1, (loras, diff.max())  # PIL images: the same up to a rounding
    finally:
        loop.close()
        engine.shutdown()


@pytest.mark.slow
def test_a_cache_trace_replays_on_the_serial_pipeline_too(flux_path, tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"prompt": "p0", "size": "16x16", "steps": 4, "guidance": 3.5, "seed": 0},
             {"prompt": "p1", "size": "16x16", "steps": 4, "guidance": 3.5, "seed": 1,
              "cache": {"method": "first_block", "threshold": 0.2}},
             {"prompt": "p2", "size": "16x16", "steps": 4, "guidance": 3.5, "seed": 2,
              "cache": {"method": "taylorseer", "cache_interval": 2, "max_order": 1}}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run.json"
    assert main(_args("--model", flux_path, "--device", "cpu", "--dtype", "float32", "--trace", str(trace),
                      "--contenders", "dvllm,serial", "--slo-factor", "1000", "--output-json", str(out))) == 0
    run = json.loads(out.read_text())["runs"][0]["contenders"]
    for name, (s,) in run.items():
        assert (s["completed"], s["failed"]) == (3, 0), (name, s["errors"])
    counts = run["dvllm"][0]["engine_counts"]
    # the two cached requests' rows: TaylorSeer predicts some steps, first_block decides per step
    assert counts["cache_skipped_rows"] > 0 and counts["cache_computed_rows"] > 0


@pytest.mark.slow
def test_sd3s_pipeline_runs_taylorseer_and_refuses_first_block_by_name(sd3_path, tmp_path):
    """SD3 has no enable_cache: the serial contender applies diffusers' TaylorSeer hook itself and cannot run its
    first block cache (its last joint block returns no text stream): that request fails there, saying why."""
    trace = tmp_path / "t.jsonl"
    lines = [{"prompt": "p0", "size": "16x16", "steps": 4, "guidance": 3.0, "seed": 0,
              "cache": {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}},
             {"prompt": "p1", "size": "16x16", "steps": 4, "guidance": 3.0, "seed": 1,
              "cache": {"method": "first_block", "threshold": 0.2}}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run.json"
    assert main(_args("--model", sd3_path, "--device", "cpu", "--dtype", "float32", "--trace", str(trace),
                      "--contenders", "dvllm,serial", "--slo-factor", "1000", "--output-json", str(out))) == 0
    run = json.loads(out.read_text())["runs"][0]["contenders"]
    (engine,), (serial,) = run["dvllm"], run["serial"]
    assert (engine["completed"], engine["failed"]) == (2, 0), engine["errors"]
    assert engine["engine_counts"]["cache_skipped_rows"] > 0
    assert (serial["completed"], serial["failed"]) == (1, 1)
    assert "first_block cache does not run on SD3Transformer2DModel" in serial["errors"][0]


@pytest.mark.slow
def test_a_video_trace_replays_against_the_engine_and_the_pipeline_serial_and_static(wan_path, tmp_path):
    from dvllm.benchmarks import traces

    lines = traces.generate("video", 3, float("inf"), seed=0, size_divisor=26)
    assert {line["size"] for line in lines} <= {"32x16", "16x32", "16x16"} and all(line["frames"] for line in lines)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(dict(line, steps=min(line["steps"], 4))) + "\n" for line in lines))
    out = tmp_path / "run.json"
    assert main(_args("--model", wan_path, "--device", "cpu", "--dtype", "float32", "--trace", str(trace),
                      "--contenders", "dvllm,serial,static", "--static-window-s", "0.2", "--output-json",
                      str(out))) == 0
    result = json.loads(out.read_text())
    for name, (s,) in result["runs"][0]["contenders"].items():
        assert (s["completed"], s["failed"]) == (3, 0), (name, s["errors"])


@pytest.mark.slow
def test_a_static_batch_of_the_pipeline_gives_the_engines_images(sd_eps_path):
    """The static contender's one pipeline call for three requests: each request's image as the engine makes it."""
    import asyncio

    import numpy as np

    from dvllm import DiffusionEngine, SamplingParams
    from dvllm.benchmarks.baselines.runner import Job, PipelineRunner

    runner = PipelineRunner(sd_eps_path, device="cpu", dtype="float32")
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    loop = asyncio.new_event_loop()
    try:
        params = [SamplingParams(num_inference_steps=4, height=16, width=16, seed=10 + i, sampler="euler_a")
                  for i in range(3)]
        prompts = [f"a red circle {i}" for i in range(3)]
        jobs = [Job(p, runner.resolve(sp), loop.create_future()) for p, sp in zip(prompts, params)]
        assert len({job.key for job in jobs}) == 1  # one call's worth
        images = runner.run(jobs)
        wants = [out.images[0] for out in engine.generate(prompts, params, use_tqdm=False)]
        for (image,), want in zip(images, wants):
            diff = np.abs(np.asarray(image, dtype=np.int16) - np.asarray(want, dtype=np.int16))
            assert diff.max() <= 1, diff.max()  # PIL images: the same up to a rounding
    finally:
        loop.close()
        engine.shutdown()


@pytest.mark.slow
def test_offline_throughput_against_serial_and_static_batches_of_several_sizes(sd_eps_path, tmp_path, capsys):
    """All at once (rate inf), a warm-up round first: the throughput ratios against serial and the best static
    batch, one static contender per size; the engine built with profile_steps says where its step time went."""
    out = tmp_path / "run.json"
    assert main(_args("--model", sd_eps_path, "--device", "cpu", "--dtype", "float32", "--generate", "uniform",
                      "--num", "4", "--rate", "inf", "--size-divisor", "32", "--clamp-steps", "2",
                      "--contenders", "serial,static,dvllm", "--static-batch-size", "2,4", "--warmup-rounds", "1",
                      "--profile-steps", "--output-json", str(out))) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert list(run["contenders"]) == ["serial", "static2", "static4", "dvllm"]
    for name, (s,) in run["contenders"].items():
        assert (s["completed"], s["failed"]) == (4, 0) and s["images_per_s"] > 0, (name, s["errors"])
    assert list(result["profiles"]) == ["dvllm"] and result["profiles"]["dvllm"]["ms_per_step"]["forward"] > 0
    printed = capsys.readouterr().out
    assert "images/s vs serial: static2 " in printed and "; vs static" in printed
    assert "dvllm's step profile over" in printed


@pytest.mark.slow
def test_a_stall_trace_times_the_loops_of_variants_with_their_threads_and_deadlines(flux_path, tmp_path):
    """The stall workload (runners, then a burst of new texts) against the engine with and without its decode
    stage and against a sequence-parallel group of one-thread processes: each engine's forward gaps, and the
    deadlines the requests carried (their SLOs), as the engine counted them."""
    out = tmp_path / "run.json"
    assert main(_args("--model", flux_path, "--device", "cpu", "--dtype", "float32", "--generate", "stall",
                      "--num", "4", "--rate", "20", "--size-divisor", "16", "--clamp-steps", "3", "--forward-gaps",
                      "--deadlines", "--engine-variant", "inloop:decode_stage=false",
                      "--engine-variant", "sp2:sequence_parallel_size=2,threads=1",
                      "--contenders", "dvllm,inloop,sp2", "--output-json", str(out))) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    for name, (s,) in run["contenders"].items():
        assert (s["completed"], s["failed"]) == (4, 0), (name, s["errors"])
        assert s["forwards"] >= 3 and 0 <= s["forward_gap_p50_s"] <= s["forward_gap_max_s"], name
        counts = s["engine_counts"]
        assert counts["deadlines_met"] + counts["deadlines_missed"] == 4, name


def test_static_sizes_and_threads_are_checked():
    from dvllm.benchmarks.harness import expand_static, static_sizes

    assert static_sizes("8") == [8] and static_sizes("1, 4,8") == [1, 4, 8]
    for bad in ("0", "4,4", "x", ""):
        with pytest.raises(ValueError, match="--static-batch-size: positive batch sizes"):
            static_sizes(bad)
    assert expand_static(["dvllm", "serial", "static"], [8]) == {"serial": 1, "static": 8}
    assert expand_static(["static", "dvllm"], [2, 4]) == {"static2": 2, "static4": 4}
    assert variants_of(["one:threads=1"]) == {"one": {"threads": 1}}
    for bad in ("0", "1.5", "true", "two"):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            variants_of([f"one:threads={bad}"])


def test_each_replay_after_the_first_sends_new_texts(tmp_path):
    """No engine finds a later round's texts in its prompt cache (a pipeline has none): rounds and warm-ups differ."""
    from dvllm.benchmarks.harness import fresh

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": "a", "negative_prompt": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    first, second = trace_workload(str(trace), size="16x16", steps=2, guidance=5.0, sampler=None)
    assert fresh(first, 0) is first
    texts = {(fresh(first, r).prompt, fresh(first, r).negative_prompt) for r in (0, 1, 2, -1)}
    assert len(texts) == 4 and all(p.startswith("a") and n.startswith("b") for p, n in texts)
    assert fresh(second, 1).negative_prompt is None and fresh(second, 1).seed == second.seed
