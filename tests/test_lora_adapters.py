"""The random adapters the harness serves (dvllm/benchmarks/lora_adapters.py, `bench run --random-loras`)."""
from __future__ import annotations

import pytest
import torch

from dvllm.benchmarks.lora_adapters import make_adapter

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
