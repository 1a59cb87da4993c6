"""Builds and loads dvllm's custom ops (csrc/) on first use.

The extension is compiled just in time with `torch.utils.cpp_extension.load` into torch's
extensions directory (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), so only
the first process on a machine pays for the compile. The CUDA kernels are built too when
torch is a CUDA build, nvcc is found and a GPU is visible. If the build fails (no compiler,
no ninja, ...) dvllm logs one warning and `dvllm.ops` uses its pure-torch reference ops.

Set DVLLM_USE_CUSTOM_OPS=0 to always use the reference ops (nothing is built).
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from dvllm.sampler_coeffs import c_enumerators

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ENV_VAR = "DVLLM_USE_CUSTOM_OPS"

_load_lock = threading.Lock()  # functools.cache alone would let two threads build at once
# torch's build holds a `lock` file in the build directory while it compiles; a build killed midway
# (Ctrl-C, a killed CI job) leaves it behind, and every later process would wait on it forever. A
# build takes a minute or two: a lock this old is left over.
STALE_BUILD_LOCK_S = 15 * 60


@torch.compiler.assume_constant_result  # torch.compile takes the answer as a constant, never traces the build
def custom_ops_available(device: str | torch.device | None = None) -> bool:
    """Whether dvllm's custom ops are loaded (builds them on the first call); with `device`,
    whether they have kernels for that device's type."""
    with _load_lock:
        devices = _load()
    if device is None:
        return bool(devices)
    # "cuda:1" -> "cuda" without building a torch.device (this runs on every op call).
    return (device.type if isinstance(device, torch.device) else device.partition(":")[0]) in devices


@functools.cache
def _load() -> frozenset[str]:
    """Builds and loads the extension; returns the device types it has kernels for."""
    if os.environ.get(ENV_VAR, "1") == "0":
        logger.info("%s=0: dvllm uses its pure-torch reference ops", ENV_VAR)
        return frozenset()
    from torch.utils import cpp_extension

    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and torch.cuda.is_available()
    sources = [CSRC / "state_ops.cpp"] + ([CSRC / "state_ops_cuda.cu"] if with_cuda else [])
    try:
        missing = [str(s) for s in sources if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"sources not found: {missing}")
        clear_stale_lock(Path(cpp_extension._get_build_directory("dvllm_C", verbose=False)))
        cpp_extension.load(
            name="dvllm_C",
            sources=[str(s) for s in sources],
            # torch's CPU build runs at::parallel_for on OpenMP, which the header needs enabled.
            # the coefficient layout, from its one definition (part of the build's hash: a change rebuilds)
            extra_cflags=["-O3", "-fopenmp", *_f16c_flags(), f"-DDVLLM_COEFFS={c_enumerators()}"],
            extra_ldflags=["-fopenmp"],
            extra_cuda_cflags=["-O3", f"-DDVLLM_COEFFS={c_enumerators()}"],
            with_cuda=with_cuda,
            is_python_module=False,  # the library registers torch.ops.dvllm.* when loaded
        )
    except Exception as e:  # any build failure: fall back, loudly once
        logger.warning("dvllm custom ops could not be built; using the slower pure-torch reference ops "
                       "(set %s=0 to skip the build). %s: %s", ENV_VAR, type(e).__name__, _tail(str(e)))
        return frozenset()
    _register_fake_impls()
    return frozenset({"cpu", "cuda"} if with_cuda else {"cpu"})


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Removes a build lock older than STALE_BUILD_LOCK_S (left by an interrupted build); True if it did."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_BUILD_LOCK_S:
        return False
    logger.warning("removing %s, left %.0f minutes ago by an interrupted build of dvllm's custom ops", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


def _register_fake_impls() -> None:
    """Fake (meta) kernels, so torch.compile can trace the ops; registered once the library is loaded
    (a fake needs its op's schema)."""
    for name in ("gather_blocks", "scatter_blocks", "scatter_update"):
        torch.library.register_fake(f"dvllm::{name}")(_write_only_fake)


def _write_only_fake(*args: object) -> None:
    """The ops return nothing and only write their `Tensor(a!)` argument, so a fake has nothing to
    compute; the wrappers in dvllm/ops.py have checked the shapes."""
    return None


def _f16c_flags() -> list[str]:
    """Hardware float16 conversion when this x86 CPU has it (every x86 CPU since 2012 does):
    without it the CPU kernels convert float16 in software, about 4x slower."""
    try:
        has_f16c = platform.machine() == "x86_64" and " f16c" in Path("/proc/cpuinfo").read_text()
    except OSError:
        has_f16c = False
    return ["-mf16c"] if has_f16c else []


def _tail(text: str, max_chars: int = 2000) -> str:
    """The end of a compiler log, where the error is."""
    text = text.strip()
    return text if len(text) <= max_chars else "..." + text[-max_chars:]
