"""Logging for the `dvllm` command: dvllm's own records on stderr, third-party chatter off by default.

Loading a pipeline makes diffusers, transformers and friends print advice (install torchvision,
install accelerate, ...) and nested "Loading ..." progress bars. None of it is actionable for someone
running `dvllm serve`, so the CLI turns it down unless --log-level is debug. Library users who build
an engine in their own process keep the libraries' defaults: only the CLI calls this.
"""
from __future__ import annotations

import logging
import sys
import warnings

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Python `warnings` raised from these packages are hidden below --log-level debug.
THIRD_PARTY_WARNING_MODULES = r"(diffusers|transformers|accelerate|torchvision|huggingface_hub|timm)(\.|$)"
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
    if not verbose:
        warnings.filterwarnings("ignore", module=THIRD_PARTY_WARNING_MODULES)


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
