"""One call of a module that step caching hooks: its original forward, its arguments, and how to run it on
some of the batch's rows only."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dvllm.worker.row_args import cut_rows
from dvllm.worker.row_scope import RowScope


@dataclass
class Call:
    """One call of a hooked module: the original forward, its signature (read once), the arguments."""

    fn: Callable
    signature: inspect.Signature
    args: tuple
    kwargs: dict
    rows: RowScope

    def run(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    @property
    def arguments(self) -> dict[str, Any]:
        return self.signature.bind(*self.args, **self.kwargs).arguments

    def on_rows(self, rows: int, chosen: list[int], index: torch.Tensor) -> Any:
        """The call on the rows `chosen` only (`index`: the same on the device): every batched argument is cut
        (worker/row_args.py)."""
        bound = self.signature.bind(*self.args, **self.kwargs)
        for name, value in list(bound.arguments.items()):
            bound.arguments[name] = cut_rows(name, value, rows, chosen, index)
        with self.rows.narrow(chosen, index):
            return self.fn(*bound.args, **bound.kwargs)
