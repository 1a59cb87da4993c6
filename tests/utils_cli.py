"""Helpers shared by the command-line tests (test_cli.py, test_cli_serve.py)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import pytest

from dvllm.entrypoints.cli import _add_serve_args, check_serve_args, main

FAST = ["--device", "cpu", "--dtype", "float32", "--no-progress", "--steps", "3", "--size", "16x16"]


def write_lines(path: Path, lines: list[str | dict]) -> Path:
    """A prompts file: plain lines as they are, dicts as JSON lines."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def expect_usage_error(capsys, *argv: str) -> str:
    """Bad input must end in exit code 2 with a one-line message, never a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"dvllm {argv[0]}: error:" in err and "Traceback" not in err
    return err


@pytest.fixture(autouse=True)
def restore_logging():
    """main() sets up logging for a command-line process (dvllm's handler and level, the libraries' verbosity
    and loading bars); put it back, so that later tests in this process see what they would alone."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    libs = (diffusers_logging, transformers_logging)
    dvllm_logger = logging.getLogger("dvllm")
    level, handlers = dvllm_logger.level, list(dvllm_logger.handlers)
    saved = [(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs]
    yield
    dvllm_logger.setLevel(level)
    dvllm_logger.handlers[:] = handlers
    for lib, (verbosity, bars) in zip(libs, saved):
        lib.set_verbosity(verbosity)
        (lib.enable_progress_bar if bars else lib.disable_progress_bar)()


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if an engine starts loading a model: the arguments must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model started loading before the arguments were checked")
    monkeypatch.setattr("dvllm.engine.engine.DiffusionEngine.__init__", refuse)
    monkeypatch.setattr("dvllm.engine.async_engine.AsyncDiffusionEngine.__init__", refuse)


THIRD_PARTY_NOISE = ["Loading pipeline components", "Loading weights", "```", "torchvision", "accelerate",
                     "Warning:"]


def assert_quiet(stderr: str) -> None:
    """None of what loading a pipeline makes the libraries print reaches the user by default."""
    for noise in THIRD_PARTY_NOISE:
        assert noise not in stderr, f"{noise!r} in stderr:\n{stderr}"


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dvllm.entrypoints.cli", *argv]


def serve_args(*flags: str) -> argparse.Namespace:
    """The namespace `dvllm serve FLAGS` makes, checked as the command checks it."""
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    args = parser.parse_args(list(flags))
    check_serve_args(args)
    return args
