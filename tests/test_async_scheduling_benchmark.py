"""The async-scheduling benchmark (dvllm/benchmarks/async_scheduling.py): both engines on the same requests."""
import json
from types import SimpleNamespace

import pytest

from dvllm.benchmarks import async_scheduling


@pytest.mark.parametrize("per_step", [0, 2], ids=["at-once", "staggered"])
@pytest.mark.slow
def test_the_async_scheduling_benchmark_runs_both_engines_on_the_same_requests(sd_eps_path, tmp_path, per_step):
    out = tmp_path / "async_scheduling.json"
    result = async_scheduling.main([
        "--model", sd_eps_path, "--load-format", "auto", "--size", "16", "--requests", "5", "--steps", "2",
        "--max-batch-size", "2", "--per-step", str(per_step), "--rounds", "1", "--output", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["requests"] == 5 and result["per_step"] == per_step
    for name in ("off", "on"):
        engine = result[name]
        assert len(engine["rounds"]) == 1
        for key in ("wall_s", "forwards_per_s", "request_steps_per_s", "mean_forward_s", "mean_gap_s"):
            assert engine[key] > 0, key
        assert engine["longest_gap_s"] >= engine["mean_gap_s"]
        assert engine["total_gap_s"] >= engine["longest_gap_s"]
        assert engine["worker_steps"] >= engine["forwards"] >= 5  # 5 requests x 2 steps, at most 2 rows a forward
        assert 0 < engine["worker_idle_s"] < engine["wall_s"]
        assert engine["worker_idle_longest_s"] >= engine["worker_idle_per_step_s"] > 0
        assert engine["worker_idle_longest_s"] >= engine["worker_idle_median_s"] > 0
    assert result["images_equal"] is True and result["images_max_abs_diff"] <= 1e-5
    for ratio in ("wall_ratio_on_off", "mean_gap_ratio_on_off", "worker_idle_ratio_on_off"):
        assert result[ratio] > 0, ratio


@pytest.mark.slow
def test_the_ray_mode_times_the_wall_and_not_the_worker(tmp_path):
    ray = pytest.importorskip("ray")
    had_ray = ray.is_initialized()
    out = tmp_path / "async_scheduling_ray.json"
    result = async_scheduling.main([
        "--model", "tiny-sd", "--size", "16", "--requests", "4", "--steps", "2", "--rounds", "1",
        "--executor", "ray", "--output", str(out)])
    assert ray.is_initialized() == had_ray  # the Ray runtime the script started is gone
    assert json.loads(out.read_text()) == result
    assert (result["executor"], result["num_workers"], result["worker_num_cpus"]) == ("ray", 1, 1)
    assert result["worker_timing"] == async_scheduling.NOT_MEASURED
    assert result["decode_stage"] is None
    for name in ("off", "on"):
        engine = result[name]
        assert len(engine["rounds"]) == 1
        assert engine["wall_s"] > 0 and engine["request_steps_per_s"] > 0
        for key in ("forwards", "mean_gap_s", "worker_idle_s", "worker_steps"):  # not measured: absent
            assert key not in engine, key
    assert result["images_equal"] is True and result["images_max_abs_diff"] <= 1e-5
    assert result["wall_ratio_on_off"] > 0
    assert result["mean_gap_ratio_on_off"] is None and result["worker_idle_ratio_on_off"] is None


def test_the_benchmark_exits_non_zero_when_the_images_differ(monkeypatch, tmp_path, capsys):
    shut = []
    monkeypatch.setattr(async_scheduling, "_engine", lambda args, on: SimpleNamespace(shutdown=lambda: shut.append(on)))
    monkeypatch.setattr(async_scheduling, "_compare",
                        lambda engines, args: {"images_max_abs_diff": 0.5, "images_equal": False})
    out = tmp_path / "differ.json"
    with pytest.raises(SystemExit) as exit_info:
        async_scheduling.main(["--output", str(out)])
    assert exit_info.value.code == 1
    assert sorted(shut) == [False, True]  # both engines shut down first
    assert json.loads(out.read_text())["images_equal"] is False  # the figures are written all the same
    assert "images differ by 0.5" in capsys.readouterr().err


def test_the_rounds_share_prompts_and_not_seeds():
    args = async_scheduling.build_parser().parse_args(["--requests", "3", "--steps", "4"])
    one, two = async_scheduling._requests(args, 1), async_scheduling._requests(args, 2)
    assert [prompt for _, prompt, _ in one] == [prompt for _, prompt, _ in two]
    assert {p.seed for _, _, p in one}.isdisjoint(p.seed for _, _, p in two)
    params = one[0][2]
    assert (params.output_kind, params.output_type, params.num_inference_steps) == ("progress", "np", 4)
