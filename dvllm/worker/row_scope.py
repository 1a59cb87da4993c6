"""Which of a forward's rows a module is running on now.

Step caching runs some modules on a subset of the batch's rows (rows that skip leave the batch); a
module that treats rows differently (a LoRA layer: each row has its own adapters) must know which
rows it got. Subsets nest: a subset of a subset is kept as rows of the whole forward, both as a host
list (to decide with, without reading the device) and as a device index (to select with).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class RowScope:
    def __init__(self) -> None:
        self._stack: list[tuple[list[int], torch.Tensor]] = []

    @property
    def rows(self) -> list[int] | None:
        """The forward's rows now running, in order (None: all of them)."""
        return self._stack[-1][0] if self._stack else None

    @property
    def index(self) -> torch.Tensor | None:
        """The same rows on the device."""
        return self._stack[-1][1] if self._stack else None

    @contextmanager
    def narrow(self, rows: list[int], index: torch.Tensor) -> Iterator[None]:
        """Runs on `rows` of the rows running now (`index`: the same numbers on the device)."""
        if self._stack:
            current, current_index = self._stack[-1]
            rows, index = [current[r] for r in rows], current_index[index]
        self._stack.append((rows, index))
        try:
            yield
        finally:
            self._stack.pop()
