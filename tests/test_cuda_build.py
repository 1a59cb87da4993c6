"""The CUDA kernels are compiled here, on a machine without a GPU: nvcc and a CUDA build of torch (in a venv of
its own, made on first use) build csrc/ for sm_80 and sm_90, and the library reports the coefficient layout nvcc
compiled into the kernels, which must be sampler_coeffs.py's. (Passed as one -D value, nvcc split the list at
its commas: the CUDA kernels read every coefficient from column 0 or 1.) A change that breaks the CUDA build
fails here, not on the first GPU.

CUDA_TORCH_PYTHON names the CUDA torch's interpreter, else ~/.cache/dvllm-cuda-venv is made (pip install
torch==2.14.1: a CUDA 13.0 build, as nvcc is here). Without nvcc the test skips, unless
DVLLM_REQUIRE_CUDA_BUILD=1 (CI sets it): then it fails.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dvllm.sampler_coeffs import layout

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
CUDA_TORCH = "torch==2.14.1"  # a CUDA 13.0 build; cpp_extension refuses an nvcc of another major version
VENV = Path.home() / ".cache" / "dvllm-cuda-venv"
ARCHS = "8.0;9.0"


def cuda_torch_python() -> str:
    given = os.environ.get("CUDA_TORCH_PYTHON")
    if given:
        return given
    python = VENV / "bin" / "python"
    if not (VENV / ".complete").is_file():  # made here once; an interrupted install is made again
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", CUDA_TORCH, "ninja"], check=True, timeout=3000)
        (VENV / ".complete").write_text(CUDA_TORCH)
    return str(python)


@pytest.mark.slow
def test_the_cuda_kernels_build_and_compile_the_layout_of_sampler_coeffs(tmp_path):
    if not (CUDA_HOME / "bin" / "nvcc").is_file():
        if os.environ.get("DVLLM_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail(f"DVLLM_REQUIRE_CUDA_BUILD=1 but there is no nvcc in {CUDA_HOME}")
        pytest.skip(f"no nvcc in {CUDA_HOME}: the CUDA kernels cannot be compiled on this machine")
    env = {**os.environ, "CUDA_HOME": str(CUDA_HOME), "TORCH_CUDA_ARCH_LIST": ARCHS, "MAX_JOBS": "2",
           "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([cuda_torch_python(), "-m", "dvllm.build_ops", "--cuda", "on", "--print-layout"],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["expected"] == layout()
    assert report["cpu"] == layout(), report  # the C++ kernels' layout
    assert report["cuda"] == layout(), report  # the CUDA kernels' layout, as nvcc compiled it
    assert report["cuda_archs"] == [800, 900], report
