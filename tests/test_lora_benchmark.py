"""`benchmark_throughput.py --loras N` end to end on tiny-sd (two adapters, two steps): every contender's
row and the step-cost rows are there, with positive figures. No timing assertions: the machine is shared."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dvllm.benchmarks.lora_adapters import make_adapter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = {"dvllm (no LoRA)", "dvllm+LoRA mixed batch", "dvllm+LoRA one adapter at a time",
              "pipeline+LoRA serial", "pipeline+LoRA one batch per adapter"}


@pytest.mark.slow
def test_lora_benchmark_reports_every_contender_and_the_step_cost(tmp_path):
    out = tmp_path / "lora.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/benchmark_throughput.py", "--model", "tiny-sd", "--device", "cpu", "--dtype",
         "float32", "--size", "16x16", "--steps", "2", "--num-requests", "4", "--loras", "2", "--rounds", "1",
         "--cost-rows", "4", "--cost-rounds", "1", "--output-json", str(out)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["images_per_s"]) == CONTENDERS and all(v > 0 for v in result["images_per_s"].values())
    assert result["adapters"] == 2 and result["rank"] == 16
    for ratio in ("lora_vs_no_lora", "lora_vs_pipeline_serial", "lora_vs_pipeline_grouped", "lora_vs_dvllm_grouped"):
        assert result[ratio] > 0
    cost = result["step_cost"]
    setups = {"no LoRA", "1 adapter on every row", "2 adapters, row i on adapter i mod 2"}
    assert set(cost) == setups | {"no_lora_step_ms", "rounds"}
    assert cost["no LoRA"] == 1.0 and all(cost[name] > 0 for name in setups) and cost["no_lora_step_ms"] > 0
    assert {name: len(r) for name, r in cost["rounds"].items()} == dict.fromkeys(setups, 1)
    for name in CONTENDERS:
        assert name in run.stdout
    assert "x the no-LoRA step" in run.stdout


@pytest.mark.parametrize("preset", ["tiny-sd", "flux-cpu"])
def test_made_adapters_change_the_attention_projections_only(tmp_path, preset):
    """What the benchmark serves: rank-16 adapters on the attention projections (and the DiT text stream's),
    with non-zero weights, that diffusers loads without complaint."""
    from dvllm.models.loader import load_adapter

    pipe = load_adapter(preset, "dummy", torch.device("cpu"), torch.float32).pipeline
    make_adapter(pipe, str(tmp_path / "a"), seed=0)
    pipe.load_lora_weights(str(tmp_path / "a"), adapter_name="a")
    denoiser = pipe.unet if preset == "tiny-sd" else pipe.transformer
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in denoiser.named_parameters() if ".lora_A." in name}
    ends = {".".join(n.split(".")[-2:]) if n.endswith("to_out.0") else n.split(".")[-1] for n in adapted}
    expected = {"to_q", "to_k", "to_v", "to_out.0"} | ({"add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}
                                                      if preset == "flux-cpu" else set())
    assert ends == expected
    b = [p for name, p in denoiser.named_parameters() if ".lora_B." in name]
    assert all(p.shape[-1] == 16 and p.abs().sum() > 0 for p in b)
