"""benchmarks/gpu/run_suite.sh's preset step (dvllm.benchmarks.preset_load), in its CPU dry run: every case
loads and steps, and the figures it writes mean what they say."""
from __future__ import annotations

import pytest
import torch

from dvllm.benchmarks import preset_load


@pytest.mark.slow
def test_each_case_measures_and_quantized_weights_are_smaller():
    plain, int8 = (preset_load.measure(case, "cpu", 1, (16, 16)) for case in preset_load.DRY_CASES[1:3])
    assert plain["case"] == "flux-cpu float32" and int8["case"] == "flux-cpu float32 (torchao:int8wo)"
    assert 0 < int8["weights_gib"] < plain["weights_gib"] and plain["step_s"] > 0 and int8["step_s"] > 0
    assert plain["size"] == "16x16" and plain["pool_blocks"] > 0


def test_weight_bytes_count_a_quantized_tensors_parts():
    weight = torch.nn.Linear(64, 64).weight
    assert preset_load._nbytes(weight) == 64 * 64 * 4
    ao = pytest.importorskip("torchao.quantization")
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    ao.quantize_(layer, ao.Int8WeightOnlyConfig())
    # int8 values, one float32 scale and one int8 zero point per row
    assert preset_load._nbytes(layer[0].weight) == 64 * 64 + 64 * 4 + 64


def test_only_names_a_known_case(tmp_path):
    with pytest.raises(SystemExit, match="no case for"):
        preset_load.main(["--dry-run", "--only", "nope", "--output-json", str(tmp_path / "x.json")])
