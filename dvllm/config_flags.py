"""EngineConfig -> command-line flags, generated from the dataclass (one source of truth)."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from dvllm.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _unwrap_optional(hints[f.name])
        helptext = _help_with_default(f.metadata.get("help", ""), f.default)
        if kind is bool:
            group.add_argument(flag, action=_BooleanFlag, default=f.default, help=helptext)
        elif "nargs" in f.metadata:  # "repeatable": each use of the flag (or an alias) adds to the list
            group.add_argument(flag, *f.metadata.get("aliases", ()), nargs=f.metadata["nargs"], default=f.default,
                               action="extend" if f.metadata.get("repeatable") else "store", help=helptext)
        else:
            base = int if kind is int else float if kind is float else str
            group.add_argument(flag, type=base, default=f.default, help=helptext)


def _help_with_default(text: str, default: Any) -> str:
    """The field's help, plus its default unless the text already tells it (or there is none to tell)."""
    text = text.replace("%", "%%")  # argparse formats help with %-style
    if default is None or "default" in text.lower():
        return text
    return f"{text} (default: {default})"


class _BooleanFlag(argparse.BooleanOptionalAction):
    """--flag / --no-flag with the help as given: Python 3.10's action appends its own "(default: ...)"."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def _unwrap_optional(kind: Any) -> Any:
    """`float | None` -> float: a flag left out keeps the default (None)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
