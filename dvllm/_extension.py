"""Builds and loads dvllm's custom ops (csrc/).

The extension is compiled with `torch.utils.cpp_extension.load` into torch's extensions directory
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions): just in time by the first process that needs
it, or ahead of time with `python -m dvllm.build_ops` (for images and Ray nodes). The CUDA kernels are built
too when torch is a CUDA build, nvcc is found and a GPU is visible (or the build is asked for them), for the
architectures in TORCH_CUDA_ARCH_LIST, else CUDA_ARCHS. A build that fails is an error that says why;
DVLLM_USE_CUSTOM_OPS=0 chooses dvllm's pure-torch reference ops instead (nothing is built). The log says once
which path runs.

The coefficient layout of the sampler update reaches the kernels as a header generated from
dvllm/sampler_coeffs.py (`dvllm_coeffs.h`, in the build directory); each kernel library reports the layout
it was compiled with (`torch.ops.dvllm.coeff_layout`, `cuda_coeff_layout`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from dvllm.sampler_coeffs import c_header

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ENV_VAR = "DVLLM_USE_CUSTOM_OPS"
NAME = "dvllm_C"
HEADER = "dvllm_coeffs.h"
# Built when TORCH_CUDA_ARCH_LIST is unset: Ampere and Hopper cubins (an sm_80 cubin runs on sm_86/89 too),
# and Hopper's PTX, which newer GPUs compile at load time. One fixed default, so that a build ahead of time and
# the one at first use produce the same commands, and the second finds nothing to do.
CUDA_ARCHS = "8.0;9.0+PTX"

_load_lock = threading.Lock()  # functools.cache alone would let two threads build at once
# torch's build holds a `lock` file in the build directory while it compiles; a build killed midway
# (Ctrl-C, a killed CI job) leaves it behind, and every later process would wait on it forever. A
# build takes a minute or two: a lock this old is left over.
STALE_BUILD_LOCK_S = 15 * 60


class CustomOpsBuildError(RuntimeError):
    """dvllm's custom ops could not be built or loaded."""


@torch.compiler.assume_constant_result  # torch.compile takes the answer as a constant, never traces the build
def custom_ops_available(device: str | torch.device | None = None) -> bool:
    """Whether dvllm's custom ops are loaded (builds them on the first call; CustomOpsBuildError if that
    fails); with `device`, whether they have kernels for that device's type."""
    with _load_lock:
        devices = _load()
    if isinstance(devices, CustomOpsBuildError):
        raise devices
    if device is None:
        return bool(devices)
    # "cuda:1" -> "cuda" without building a torch.device (this runs on every op call).
    return (device.type if isinstance(device, torch.device) else device.partition(":")[0]) in devices


@functools.cache
def _load() -> frozenset[str] | CustomOpsBuildError:
    """Builds and loads the extension: the device types it has kernels for, or the build's error (kept, so
    that every later call raises it again instead of building again)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        logger.info("%s=0: dvllm runs its pure-torch reference ops", ENV_VAR)
        return frozenset()
    with_cuda = cuda_build_possible() and torch.cuda.is_available()
    try:
        build(with_cuda)
    except Exception as e:
        return CustomOpsBuildError(
            f"dvllm's custom ops could not be built ({type(e).__name__}: {_tail(str(e))}). Install what the build "
            f"needs (a C++ compiler and ninja; nvcc for the CUDA kernels), or set {ENV_VAR}=0 to run dvllm's "
            "pure-torch reference ops instead.")
    _register_fake_impls()
    devices = frozenset({"cpu", "cuda"} if with_cuda else {"cpu"})
    logger.info("dvllm custom ops: %s kernels", " and ".join(sorted(devices)))
    return devices


def cuda_build_possible() -> bool:
    """torch is a CUDA build and nvcc is found (a GPU need not be visible)."""
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def build(with_cuda: bool, verbose: bool = False) -> Path:
    """Compiles (if anything changed) and loads the library; returns the build directory."""
    from torch.utils import cpp_extension

    sources = [CSRC / "state_ops.cpp"] + ([CSRC / "state_ops_cuda.cu"] if with_cuda else [])
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"sources not found: {missing}")
    build_dir = Path(cpp_extension._get_build_directory(NAME, verbose=verbose))
    clear_stale_lock(build_dir)
    include_dir, digest = write_header(build_dir)
    # The header's digest is a flag: torch's build hash covers flags, not included headers.
    layout = f"-DDVLLM_COEFFS_DIGEST={digest}"
    old_archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if with_cuda and old_archs is None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = CUDA_ARCHS  # read by cpp_extension during this build only
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in sources],
            # torch's CPU build runs at::parallel_for on OpenMP, which the header needs enabled.
            extra_cflags=["-O3", "-fopenmp", *_f16c_flags(), layout],
            extra_ldflags=["-fopenmp"],
            extra_cuda_cflags=["-O3", layout],
            extra_include_paths=[str(include_dir)],
            with_cuda=with_cuda,
            is_python_module=False,  # the library registers torch.ops.dvllm.* when loaded
            verbose=verbose,
        )
    finally:
        if with_cuda and old_archs is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    return build_dir


def write_header(build_dir: Path) -> tuple[Path, str]:
    """Writes dvllm_coeffs.h into build_dir/include (atomically, only if it changed): (that folder, its digest)."""
    text = c_header()
    include_dir = build_dir / "include"
    include_dir.mkdir(parents=True, exist_ok=True)
    path = include_dir / HEADER
    if not path.is_file() or path.read_text() != text:
        tmp = include_dir / f".{HEADER}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(text)
        tmp.replace(path)
    return include_dir, hashlib.sha256(text.encode()).hexdigest()[:16]


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
