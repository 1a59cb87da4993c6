"""Loads dvllm's kernels (csrc/): the package's library, else a build just in time, else none.

1. The package's library, `dvllm/_C.<suffix>.so`, compiled by setup.py when the package was built (a wheel,
   `pip install .`, `pip install -e .`). It is loaded only if its build info (kernel_sources.py) fits: the same
   torch release, the CUDA of torch for CUDA kernels, sampler_coeffs.py's layout, and, in a source checkout,
   the sources in csrc/ as they are now (an editable checkout whose csrc/ changed rebuilds instead).
2. In a source checkout only (csrc/ beside the package): a build just in time with torch.utils.cpp_extension,
   into a directory per environment and sources (`build_directory`), so different venvs and checkouts never
   rebuild for each other. With CUDA kernels when torch is a CUDA build, nvcc is found and a GPU is visible.
3. Else dvllm runs its pure-torch reference ops (dvllm/ops.py), and warns once, saying why and how to get
   the kernels.

DVLLM_USE_CUSTOM_OPS: unset: as above; `1`: no kernels is an error (CustomOpsBuildError, naming why); `0`: the
reference ops, nothing loaded. `custom_ops_status()` tells what was loaded (the worker reports it in
/v1/models and the `dvllm_custom_ops_info` metric).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dvllm import kernel_sources
from dvllm.sampler_coeffs import c_header, layout

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE.parent / "csrc"
ENV_VAR = "DVLLM_USE_CUSTOM_OPS"
NAME = "dvllm_C"  # the just-in-time library's name
CUDA_ARCHS = kernel_sources.CUDA_ARCHS
_GET_KERNELS = ("pip install a wheel of dvllm built with its kernels (`pip install .` builds them; a C++ compiler is "
                "needed at build time only), or run from a source checkout with a C++ compiler and ninja")

_load_lock = threading.Lock()  # functools.cache alone would let two threads build at once
# torch's build holds a `lock` file in the build directory while it compiles; a build killed midway
# (Ctrl-C, a killed CI job) leaves it behind, and every later process would wait on it forever. A
# build takes a minute or two: a lock this old is left over.
STALE_BUILD_LOCK_S = 15 * 60


class CustomOpsBuildError(RuntimeError):
    """dvllm's custom ops could not be built or loaded."""


@dataclass(frozen=True)
class CustomOps:
    """What this process runs: kernels for these device types, from where, and why not from the package."""

    kernels: tuple[str, ...]  # ("cpu",), ("cpu", "cuda"), or (): the reference ops everywhere
    source: str               # "package", "jit" or "none"
    reason: str | None = None  # why the package's library is not the one loaded (None: it is)
    library: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kernels": list(self.kernels), "source": self.source, "reason": self.reason}


@torch.compiler.assume_constant_result  # torch.compile takes the answer as a constant, never traces the build
def custom_ops_available(device: str | torch.device | None = None) -> bool:
    """Whether dvllm's custom ops are loaded (loads or builds them on the first call; CustomOpsBuildError if
    DVLLM_USE_CUSTOM_OPS=1 and there are none); with `device`, whether they have kernels for that device's type."""
    kernels = custom_ops_status().kernels
    if device is None:
        return bool(kernels)
    # "cuda:1" -> "cuda" without building a torch.device (this runs on every op call).
    return (device.type if isinstance(device, torch.device) else device.partition(":")[0]) in kernels


def custom_ops_status() -> CustomOps:
    """What this process runs (loading or building the kernels on the first call; CustomOpsBuildError if
    DVLLM_USE_CUSTOM_OPS=1 and there are none)."""
    with _load_lock:
        status = _load()
    if isinstance(status, CustomOpsBuildError):
        raise status
    return status


@functools.cache  # one answer per process, as there is one loaded library
def _load() -> CustomOps | CustomOpsBuildError:
    """Loads the kernels: what runs, or the error (kept, so that every later call raises it again instead of
    building again)."""
    mode = os.environ.get(ENV_VAR, "")
    if mode not in ("", "0", "1"):
        return CustomOpsBuildError(f"{ENV_VAR} must be 0, 1 or unset, got {mode!r}")
    if mode == "0":
        logger.info("%s=0: dvllm runs its pure-torch reference ops", ENV_VAR)
        return CustomOps((), "none", f"{ENV_VAR}=0")
    status = _find()
    if not status.kernels and mode == "1":
        return CustomOpsBuildError(f"dvllm's custom ops could not be loaded or built: {status.reason}. To get them: "
                                   f"{_GET_KERNELS}; or unset {ENV_VAR} to run dvllm's pure-torch reference ops.")
    if not status.kernels:
        logger.warning("dvllm runs its pure-torch reference ops (slower), not its kernels: %s. To get the kernels: "
                       "%s. %s=0 chooses the reference ops without this warning; %s=1 makes it an error.",
                       status.reason, _GET_KERNELS, ENV_VAR, ENV_VAR)
        return status
    _register_fake_impls()
    how = "loaded from the package" if status.source == "package" else "built just in time"
    logger.info("dvllm custom ops: %s kernels, %s (%s)%s", " and ".join(status.kernels), how, status.library,
                f"; not the package's: {status.reason}" if status.reason else "")
    if "cuda" not in status.kernels and torch.cuda.is_available():
        logger.warning("dvllm's kernels have no CUDA build here: tensors on the GPU use the pure-torch reference "
                       "ops. A wheel built with nvcc and a CUDA torch has them.")
    return status


def _find() -> CustomOps:
    """The package's library if it fits, else a build just in time (source checkouts), else none."""
    want_cuda = cuda_build_possible() and torch.cuda.is_available()
    library, why_not = packaged_library(want_cuda)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
            return CustomOps(tuple(kernel_sources.read_build_info(library)["kernels"]), "package", None, str(library))
        except OSError as e:  # nothing was registered: a build just in time may still load
            why_not = f"{library.name} did not load ({_tail(str(e), 300)})"
    if not source_checkout():
        return CustomOps((), "none", why_not)
    try:
        build_dir = build(want_cuda)
    except Exception as e:
        return CustomOps((), "none", f"{why_not}; and the build just in time failed ({type(e).__name__}: "
                                     f"{_tail(str(e))})")
    return CustomOps(("cpu", "cuda") if want_cuda else ("cpu",), "jit", why_not, str(build_dir / f"{NAME}.so"))


def packaged_library(want_cuda: bool = False) -> tuple[Path | None, str | None]:
    """(the package's library, None) if it fits this environment, else (None, why not)."""
    found = [PACKAGE / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    library = next((p for p in found if p.is_file()), None)
    if library is None:
        return None, "the package has no kernel library (dvllm/_C*.so: it was installed without building csrc/)"
    info = kernel_sources.read_build_info(library)
    if info is None:
        return None, f"{library.name} carries no build info"
    if info["torch"].split("+")[0] != torch.__version__.split("+")[0]:
        return None, f"{library.name} was built for torch {info['torch']}, and this is torch {torch.__version__}"
    if "cuda" in info["kernels"] and (torch.version.cuda or "").split(".")[0] != info["cuda"].split(".")[0]:
        return None, (f"{library.name} has CUDA {info['cuda']} kernels, and this torch {torch.__version__} "
                      f"has CUDA {torch.version.cuda}")
    if info["layout"] != layout():
        return None, f"{library.name} was compiled with another coefficient layout than dvllm/sampler_coeffs.py's"
    if source_checkout():
        if info["digest"] != kernel_sources.source_digest(CSRC, c_header()):
            return None, f"csrc/ changed since {library.name} was built (reinstall, or it is rebuilt just in time)"
        if want_cuda and "cuda" not in info["kernels"]:
            return None, f"{library.name} has no CUDA kernels, and they can be built here"
    return library, None


def source_checkout() -> bool:
    """The package runs from a source tree (an editable install, PYTHONPATH): csrc/ and setup.py beside it."""
    return (CSRC / kernel_sources.CPU_SOURCES[0]).is_file() and (PACKAGE.parent / "setup.py").is_file()


def cuda_build_possible() -> bool:
    """torch is a CUDA build and nvcc is found (a GPU need not be visible)."""
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def build_directory(digest: str, with_cuda: bool, prefix: str | None = None) -> Path:
    """Where the build just in time goes: one directory per sources digest, torch, CPU or CUDA build, Python
    and environment (sys.prefix), under TORCH_EXTENSIONS_DIR/dvllm or ~/.cache/dvllm/ops."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(base) / "dvllm" if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "dvllm" / "ops"
    env = hashlib.sha256((sys.prefix if prefix is None else prefix).encode()).hexdigest()[:10]
    kind = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda else "cpu"
    return root / f"{digest}-torch{torch.__version__}-{kind}-py{sys.version_info[0]}{sys.version_info[1]}-{env}"


def build(with_cuda: bool, verbose: bool = False) -> Path:
    """Compiles (if not built yet for this environment and these sources) and loads the library; returns its
    build directory."""
    from torch.utils import cpp_extension

    names = kernel_sources.CPU_SOURCES + (kernel_sources.CUDA_SOURCES if with_cuda else ())
    sources = [CSRC / name for name in names]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"sources not found: {missing}")
    header = c_header()
    digest = kernel_sources.source_digest(CSRC, header)
    build_dir = build_directory(digest, with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or CUDA_ARCHS
    info = kernel_sources.build_info(digest, torch.__version__, layout(), torch.version.cuda if with_cuda else None,
                                     archs)
    include_dir = kernel_sources.write_headers(build_dir / "include", header, info)
    fresh = not (build_dir / f"{NAME}.so").is_file()
    if fresh:
        logger.warning("building dvllm's kernels (first run in this environment only, about a minute) in %s",
                       build_dir)
    old_archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if with_cuda and old_archs is None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = CUDA_ARCHS  # read by cpp_extension during this build only
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in sources],
            extra_cflags=kernel_sources.cxx_flags(header),
            extra_ldflags=list(kernel_sources.LDFLAGS),
            extra_cuda_cflags=kernel_sources.nvcc_flags(header),
            extra_include_paths=[str(include_dir)],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            is_python_module=False,  # the library registers torch.ops.dvllm.* when loaded
            verbose=verbose,
        )
    finally:
        if with_cuda and old_archs is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    if fresh:
        logger.warning("built dvllm's kernels in %.0f s", time.perf_counter() - start)
    return build_dir


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


def _tail(text: str, max_chars: int = 2000) -> str:
    """The end of a compiler log, where the error is."""
    text = text.strip()
    return text if len(text) <= max_chars else "..." + text[-max_chars:]
