"""The encode-stall benchmark (dvllm/benchmarks/encode_stall.py): both engines on the same bursts, and its helpers."""
import json
from types import SimpleNamespace

import pytest

from dvllm.benchmarks.encode_stall import _check, burst_texts, main, percentile
from dvllm.benchmarks.loop_stall import gaps


@pytest.mark.slow
def test_the_encode_stall_benchmark_runs_both_engines_on_the_same_bursts(sd_eps_path, tmp_path):
    out = tmp_path / "encode_stall.json"
    result = main(["--model", sd_eps_path, "--size", "16", "--burst", "3", "--runners", "1", "--steps", "2",
                   "--rounds", "1", "--output", str(out)])
    assert json.loads(out.read_text()) == result
    for name in ("off", "on"):
        engine = result[name]
        assert len(engine["rounds"]) == 1
        assert engine["longest_gap_s"] >= engine["mean_gap_s"] > 0
        assert engine["longest_gap_s"] >= engine["admission_gap_s"] > 0
        assert engine["wall_s"] >= engine["burst_latency_p95_s"] >= engine["burst_latency_p50_s"] > 0
        assert engine["admission_steps"] == 1  # the whole burst joins at once, with the stage or without
    assert result["off"]["steps_to_admit"] == 1  # without the stage, the next step admits (and encodes) it
    assert result["on"]["steps_to_admit"] >= 2   # with it, the burst joins once the stage has its texts
    assert result["gap_ratio_on_off"] > 0 and result["wall_ratio_on_off"] > 0
    assert result["burst_chars"] <= result["prompt_chars_per_step"]
    assert result["burst_images_max_abs_diff"] < 1e-5
    assert "workers" not in result and "workers_images_max_abs_diff" not in result  # no encode workers: two engines


@pytest.mark.slow
def test_the_encode_stall_benchmark_adds_the_stage_with_encode_workers(sd_eps_path):
    result = main(["--model", sd_eps_path, "--size", "16", "--burst", "3", "--runners", "1", "--steps", "2",
                   "--rounds", "1", "--encode-workers", "1"])
    workers = result["workers"]
    assert len(workers["rounds"]) == 1
    assert workers["longest_gap_s"] >= workers["mean_gap_s"] > 0
    assert workers["wall_s"] >= workers["burst_latency_p95_s"] >= workers["burst_latency_p50_s"] > 0
    assert workers["admission_steps"] == 1
    assert result["encode_workers"] == 1 and result["encode_device"] is None
    assert result["gap_ratio_workers_off"] > 0 and result["wall_ratio_workers_off"] > 0
    assert result["workers_images_max_abs_diff"] < 1e-5  # against both the stage-off and the in-process stage's
    assert result["burst_images_max_abs_diff"] < 1e-5


def test_burst_texts_are_new_in_every_round_and_the_same_for_both_engines():
    rounds = [burst_texts(r, 16, 60) for r in range(3)]
    texts = [text for burst in rounds for pair in burst for text in pair]
    assert len(set(texts)) == len(texts)
    starts = [text[:30] for text in texts]  # they differ where a 77-token tokenizer still reads them
    assert len(set(starts)) == len(starts)
    assert burst_texts(1, 16, 60) == rounds[1]
    prompt, negative = rounds[0][0]
    assert len(prompt.split()) == 60 and len(negative.split()) == 20


def test_percentile_and_gaps():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert percentile([], 50) != percentile([], 50)  # nan
    assert gaps([(0.0, 1.0), (1.5, 2.0), (4.0, 5.0)]) == [0.5, 2.0]
    assert gaps([(0.0, 1.0)]) == []


def test_a_round_stops_on_a_failed_request_or_a_runner_that_finishes_before_the_burst():
    def out(request_id, finished=False, error=None):
        return SimpleNamespace(request_id=request_id, finished=finished, error=error)

    fine = [out("runner-1-0"), out("burst-1-0", finished=True)]
    assert _check(fine) == fine
    with pytest.raises(RuntimeError, match="raise --runner-steps"):
        _check([out("runner-1-0", finished=True)])
    with pytest.raises(RuntimeError, match="burst-1-2 failed: boom"):
        _check([out("burst-1-2", finished=True, error="boom")])
