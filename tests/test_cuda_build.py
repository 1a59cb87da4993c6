"""The CUDA kernels are compiled here, on a machine without a GPU, the way a CUDA wheel is built: `pip wheel
--no-build-isolation` with nvcc and a CUDA build of torch (in a venv of its own, made on first use) compiles csrc/
into the wheel's library for dvllm's default architectures (sm_80, sm_90 and its PTX). The wheel is installed, and
in a process without nvcc or CUDA_HOME the package's library is loaded and reports the coefficient layout nvcc
compiled into the kernels, which must be sampler_coeffs.py's, and the architectures. (Passed as one -D value, nvcc
split the list at its commas: the CUDA kernels read every coefficient from column 0 or 1.) A change that breaks the
CUDA build fails here, not on the first GPU.

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
import zipfile
from pathlib import Path

import pytest

from dvllm.sampler_coeffs import layout

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
CUDA_TORCH = "torch==2.14.1"  # a CUDA 13.0 build; cpp_extension refuses an nvcc of another major version
VENV = Path.home() / ".cache" / "dvllm-cuda-venv"


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


def copy_sources(dest: Path) -> Path:
    """What a wheel is built from (no editable checkout's library, no caches)."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "_C*.so", "*.egg-info")
    for folder in ("requirements", "csrc", "dvllm"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    return dest


def without_nvcc(env: dict[str, str]) -> dict[str, str]:
    """The environment of a machine that has the wheel and no CUDA toolkit to compile with."""
    env = {k: v for k, v in env.items() if k not in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (Path(p) / "nvcc").exists())
    return env


@pytest.mark.slow
def test_the_cuda_wheel_builds_and_its_kernels_compile_the_layout_of_sampler_coeffs(tmp_path):
    if not (CUDA_HOME / "bin" / "nvcc").is_file():
        if os.environ.get("DVLLM_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail(f"DVLLM_REQUIRE_CUDA_BUILD=1 but there is no nvcc in {CUDA_HOME}")
        pytest.skip(f"no nvcc in {CUDA_HOME}: the CUDA kernels cannot be compiled on this machine")
    python = cuda_torch_python()
    (tmp_path / "src").mkdir()
    src = copy_sources(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}  # dvllm's default architectures
    env.update(CUDA_HOME=str(CUDA_HOME), MAX_JOBS="2", PATH=f"{CUDA_HOME / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    done = subprocess.run([python, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                           "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (wheel,) = (tmp_path / "dist").glob("dvllm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read("dvllm-0.1.0.dist-info/METADATA").decode()
        assert any(n.startswith("dvllm/_C.") and n.endswith(".so") for n in z.namelist())
    assert f"Requires-Dist: {CUDA_TORCH}" in metadata.splitlines()  # the torch it was built against
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True, timeout=300)
    env = without_nvcc({**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    done = subprocess.run([python, "-m", "dvllm.build_ops", "--print-layout"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["source"] == "package" and str(tmp_path / "site") in report["library"], report
    assert report["expected"] == layout()
    assert report["cpu"] == layout(), report  # the C++ kernels' layout
    assert report["cuda"] == layout(), report  # the CUDA kernels' layout, as nvcc compiled it
    assert {800, 900} <= set(report["cuda_archs"]), report
