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
    transformer_shape,
    ulysses_bytes_per_rank,
)


def test_the_presets_shapes_are_their_architectures():
    flux = transformer_shape("flux-dev", 1024, 512)
    assert (flux.tokens, flux.layers, flux.width) == (64 * 64 + 512, 19 + 38, 24 * 128)
    assert 11.8e9 < flux.parameters < 12.0e9  # FLUX.1-dev's published 12B
    qwen = transformer_shape("qwen-image", 2048, 128)
    assert (qwen.tokens, qwen.layers) == (128 * 128 + 128, 60) and 20.0e9 < qwen.parameters < 20.6e9  # 20B


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
