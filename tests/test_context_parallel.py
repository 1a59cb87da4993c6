"""Sequence parallelism through diffusers' context parallelism: a forward split across a group of 2 CPU processes
(gloo, Ulysses) equals the forward alone, for the families diffusers has a plan for; what cannot work is refused
before a group starts. (The engine's worker groups build on this: issue "One request across several GPUs".)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dvllm.models.loader import load_adapter
from dvllm.parallel.context_parallel import check_context_parallel, has_plan

_MEMBER = str(Path(__file__).with_name("cp_member.py"))
_TIMEOUT_S = 300  # two interpreters importing torch and diffusers, on a loaded machine


@pytest.mark.parametrize("family", ["flux_path", "qwen_image_path"])
@pytest.mark.slow
def test_a_forward_split_across_two_processes_equals_the_forward_alone(family, request, tmp_path):
    model, out = request.getfixturevalue(family), tmp_path / "out.pt"
    members = [subprocess.Popen([sys.executable, _MEMBER, str(rank), "2", str(tmp_path / "init"), model, "2",
                                 str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    for member in members:
        output, _ = member.communicate(timeout=_TIMEOUT_S)
        assert member.returncode == 0, output.decode()[-3000:]
    result = torch.load(out)
    assert result["split"].shape == result["alone"].shape and result["block_tokens"] == 16 // 2  # split, gathered
    torch.testing.assert_close(result["split"], result["alone"], rtol=0, atol=1e-5)


def test_what_cannot_be_split_is_refused(sd3_path, flux_path):
    sd3 = load_adapter(sd3_path, "auto", torch.device("cpu"), torch.float32).pipeline.transformer
    assert not has_plan(sd3)
    check_context_parallel(sd3, 1, 1, torch.device("cpu"))  # degree 1: nothing to split
    with pytest.raises(ValueError, match="no context-parallel plan"):
        check_context_parallel(sd3, 2, 1, torch.device("cpu"))
    flux = load_adapter(flux_path, "auto", torch.device("cpu"), torch.float32).pipeline.transformer
    heads = flux.config.num_attention_heads
    with pytest.raises(ValueError, match="must divide the model's"):
        check_context_parallel(flux, heads + 1, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="log-sum-exp"):
        check_context_parallel(flux, 1, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="integer >= 1"):
        check_context_parallel(flux, 0, 1, torch.device("cpu"))
