"""Logging: dvllm's own records on stderr, third-party chatter off by default.

Loading a pipeline makes diffusers, transformers and friends print advice (install torchvision,
install accelerate, ...), torchao its optional kernels that failed to load, torch deprecations of
what torchao registers, and nested "Loading ..." progress bars. None of it is actionable for someone
running `dvllm serve`, so the CLI turns it down for the whole process unless --log-level is debug
(setup_logging). A library user's process is theirs: DiffusionEngine quiets those loggers only while
its own calls run, and leaves alone any the user has set (quiet_libraries).

What a starting process is doing (importing torch and diffusers, loading the model: a minute on a
loaded machine) is logged on STARTUP_LOGGER, which the CLI shows at both commands' default levels.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Python `warnings` raised from these packages are hidden below --log-level debug.
THIRD_PARTY_WARNING_MODULES = r"(diffusers|transformers|accelerate|torchvision|huggingface_hub|timm)(\.|$)"
# Loggers (besides diffusers' and transformers', set through their own switches) that only talk while a model
# loads: torchao's "Failed to load ..._C_mxfp8...so", torch's register_constant deprecation for torchao's enums.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "accelerate")
STARTUP_LOGGER = "dvllm.startup"
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def setup_logging(level: str, libraries: bool = True) -> None:
    """dvllm's loggers at `level` on stderr; third-party logs, warnings and loading bars off unless debug.
    libraries=False leaves the libraries for later (set_third_party_verbosity imports them: seconds)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {list(LOG_LEVELS)}, got {level!r}")
    root = logging.getLogger("dvllm")
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
    root.setLevel(level.upper())
    # start-up progress shows at generate's default (warning) as at serve's (info); error and critical hide it
    startup = logging.getLogger(STARTUP_LOGGER)
    startup.setLevel(logging.INFO if root.level <= logging.WARNING else logging.NOTSET)
    if libraries:
        set_third_party_verbosity(verbose=level == "debug")


def set_third_party_verbosity(verbose: bool) -> None:
    """verbose: the libraries' warnings and progress bars as they come; else errors only, no bars."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    for lib in (diffusers_logging, transformers_logging):
        if verbose:
            lib.set_verbosity_warning()
            lib.enable_progress_bar()
        else:
            lib.set_verbosity_error()
            lib.disable_progress_bar()  # "Loading pipeline components...", "Loading weights"
    # transformers' switch turns the Hub's download bars off too; a download of gigabytes is worth
    # watching, so they stay (HF_HUB_DISABLE_PROGRESS_BARS=1 still wins: its warning is not needed).
    import huggingface_hub.utils as hub_utils

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hub_utils.enable_progress_bars()
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    if not verbose:
        warnings.filterwarnings("ignore", module=THIRD_PARTY_WARNING_MODULES)


# "1" when a child's parent shows the libraries' logs (its dvllm logger at DEBUG): set by child_process.child_env
LIBRARY_LOGS_ENV = "DVLLM_LIBRARY_LOGS"


def child_library_logs() -> bool:
    """In a process dvllm started (child_process.py): whether its parent shows the libraries' logs."""
    return os.environ.get(LIBRARY_LOGS_ENV) == "1"


def quiet_child_libraries() -> None:
    """First thing in a process dvllm started (the engine core, a stage worker, a group member: its stderr is its
    parent's), before its imports, some of which load torchao: the libraries' logs off unless the parent shows them.
    No import: diffusers and transformers read their verbosity from the environment when first imported (a user's
    own setting wins), the other loggers are set now. Their loading bars need them imported: set_third_party_verbosity
    (verbose=child_library_logs()) does that once the process has imported them."""
    if child_library_logs():
        return
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=THIRD_PARTY_WARNING_MODULES)


_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_restore: list = []  # what the outermost quiet_libraries put back on leaving


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For a library user's process: while dvllm's own calls run (an engine's start, generate(), a sampler
    built for a request), the libraries' loggers at their defaults are at ERROR and their loading bars off;
    then put back. A logger the user has set to another level keeps it, and a dvllm logger at DEBUG (what
    `--log-level debug` sets) shows everything. Nested and concurrent scopes share one: the last out restores."""
    global _quiet_depth
    if logging.getLogger("dvllm").isEnabledFor(logging.DEBUG):
        yield
        return
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_restore[:] = _quiet()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                for restore in _quiet_restore:
                    restore()
                _quiet_restore.clear()


def _quiet() -> list:
    """Quiets what is at its default; returns what undoes it."""
    import diffusers.utils.logging as diffusers_logging  # (configures its root logger first: it would reset ours)
    import transformers.utils.logging as transformers_logging

    undo = []
    for name in ("diffusers", "transformers", *NOISY_LOGGERS):
        logger = logging.getLogger(name)
        if logger.level in (logging.NOTSET, logging.WARNING):  # the default: nobody chose it
            undo.append(lambda logger=logger, level=logger.level: logger.setLevel(level))
            logger.setLevel(logging.ERROR)
    for lib in (diffusers_logging, transformers_logging):
        if lib.is_progress_bar_enabled():
            lib.disable_progress_bar()
            undo.append(lib.enable_progress_bar)
    return undo


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes, not as it was when the handler was made:
    whoever swaps sys.stderr later (a test's capture, an embedding app) still gets the records."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass
