"""The group arithmetic (dvllm.sizing.group_arithmetic): the presets' real shapes, the all-to-all volume a
rank sends, and the bound it gives, labelled as arithmetic."""
from __future__ import annotations

import json

import pytest

from dvllm.sizing.group_arithmetic import (
    Shape,
    forward_flops,
    main,
    predict,
    predict_cfg,
    transformer_shape,
    ulysses_bytes_per_rank,
)


def test_the_presets_shapes_are_their_architectures():
    flux = transformer_shape("flux-dev", 1024, 512)
    assert (flux.tokens, flux.layers, flux.width) == (64 * 64 + 512, 19 + 38, 24 * 128)
    assert 11.8e9 < flux.parameters < 12.0e9  # FLUX.1-dev's published 12B
    qwen = transformer_shape("qwen-image", 2048, 128)
    assert (qwen.tokens, qwen.layers) == (128 * 128 + 128, 60) and 20.0e9 < qwen.parameters < 20.6e9  # 20B


def test_the_mlperf_clip_is_wans_video_tokens_at_its_defaults(tmp_path):
    """MLPerf's Wan2.2 clip (the mlperf preset's defaults): 81 frames are 21 latent frames, 720x1280 is 45x80
    patches of 2x2 latents; one 14B expert runs a step. Its CFG rows split both ways on 1, 2, 4 and 8 GPUs."""
    wan = transformer_shape("wan2.2-t2v-a14b-mlperf", (720, 1280), 512, 81)
    assert (wan.tokens, wan.layers, wan.width) == (21 * 45 * 80, 40, 40 * 128)  # the text is not in the sequence
    assert 14.2e9 < wan.parameters < 14.4e9
    out = tmp_path / "mlperf.json"
    main(["--preset", "wan2.2-t2v-a14b-mlperf", "--out", str(out)])
    result = json.loads(out.read_text())
    assert (result["size"], result["frames"], result["steps"], result["tokens"]) == ("720x1280", 81, 20, 75600)
    degrees = [(r["gpus"], r["cfg_degree"], r["sp_degree"]) for r in result["cfg_parallel"]]
    assert degrees == [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 4), (4, 2, 2), (8, 1, 8), (8, 2, 4)]
    for row in result["cfg_parallel"]:
        assert row["request_s"] == pytest.approx(20 * row["step_s"]) and row["speedup_bound"] <= row["gpus"]


def test_cfg_parallel_exchanges_one_rows_tokens_at_half_the_degree():
    shape = Shape(tokens=1000, layers=3, width=64, parameters=10)
    rows = {(r["gpus"], r["cfg_degree"]): r for r in predict_cfg(shape, [1, 2, 4], 1.0, 1.0, out_features=8)}
    assert rows[1, 1]["exchange_mb_per_rank"] == 0 and (3, 2) not in rows
    # CFG x2 on 2 GPUs: no all-to-all, only the other half's output (1000 tokens x 8 numbers in bf16)
    assert rows[2, 2]["exchange_mb_per_rank"] * 1e6 == 1000 * 8 * 2
    # on 4: one row's tokens at degree 2 (and the output), against both rows' at degree 4
    assert rows[4, 2]["exchange_mb_per_rank"] * 1e6 == ulysses_bytes_per_rank(shape, 2) + 500 * 8 * 2
    assert rows[4, 1]["exchange_mb_per_rank"] * 1e6 == 2 * ulysses_bytes_per_rank(shape, 4)
    assert rows[4, 2]["compute_s"] == rows[4, 1]["compute_s"] == pytest.approx(rows[1, 1]["compute_s"] / 4)


def test_a_bad_size_is_named():
    with pytest.raises(ValueError, match="--size must be a side or HEIGHTxWIDTH"):
        main(["--preset", "flux-dev", "--size", "720x"])


def test_the_exchange_is_four_all_to_alls_a_layer():
    shape = Shape(tokens=1000, layers=3, width=64, parameters=10)
    assert ulysses_bytes_per_rank(shape, 1) == 0
    # each rank: 4 tensors of 500 x 64 bf16 a layer, half of each sent
    assert ulysses_bytes_per_rank(shape, 2) == 3 * 4 * 500 * 64 * 2 / 2
    assert forward_flops(shape) == 2 * 10 * 1000 + 4 * 1000 ** 2 * 64 * 3
    rows = predict(shape, [1, 2], tflops=1e-6, link_gbps=1.0)
    assert rows[0]["speedup_bound"] == pytest.approx(1.0) and 1.0 < rows[1]["speedup_bound"] < 2.0


def test_the_report_says_it_is_arithmetic(tmp_path, capsys):
    out = tmp_path / "a.json"
    main(["--preset", "flux-dev", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "arithmetic, not measured"
    assert [r["gpus"] for r in result["sequence_parallel"]] == [1, 2, 4, 8]
    assert "not measured" in capsys.readouterr().out


def test_the_one_device_measurement_runs_its_collectives_and_labels_the_arithmetic(tmp_path, capsys):
    """group_on_device's dry run on the CPU (a gloo group of one): the forwards and exchanges measured, the N-GPU
    rows built from them; a preset without a Flux transformer is refused."""
    from dvllm.benchmarks.group_on_device import main as measure

    out = tmp_path / "device.json"
    measure(["--preset", "flux-cpu", "--size", "128", "--text-tokens", "16", "--device", "cpu", "--dtype", "float32",
             "--rounds", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"].startswith("measured on one device") and result["tokens"] == 8 * 8 + 16
    assert result["forward_1_row_s"] > 0 and result["forward_2_rows_s"] > 0
    rows = result["sequence_parallel"]
    assert [r["gpus"] for r in rows] == [2, 4, 8]
    for row in rows:
        assert row["on_device_collectives_s"] > 0 and row["on_device_copies_s"] > 0
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["link_s"] + row["collective_overhead_s"])
        assert row["speedup_bound"] == pytest.approx(result["forward_1_row_s"] / row["step_s"])
    assert "Ulysses on 8 GPUs" in capsys.readouterr().out
    with pytest.raises(ValueError, match="Flux"):
        measure(["--preset", "wan-cpu", "--size", "64", "--device", "cpu", "--dtype", "float32", "--rounds", "1"])
