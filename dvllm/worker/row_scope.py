"""Which of a forward's rows a module is running on now.

Step caching runs some modules on a subset of the batch's rows (rows that skip leave the batch); a
module that treats rows differently (a LoRA layer: each row has its own adapters) must know which
rows it got. Subsets nest: a subset of a subset is kept as rows of the whole forward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class RowScope:
    def __init__(self) -> None:
        self._stack: list[torch.Tensor] = []

    @property
    def rows(self) -> torch.Tensor | None:
        """The forward's rows now running, in order (None: all of them)."""
        return self._stack[-1] if self._stack else None

    @contextmanager
    def narrow(self, index: torch.Tensor) -> Iterator[None]:
        """Runs on `index` of the rows running now."""
        current = self.rows
        self._stack.append(index if current is None else current[index])
        try:
            yield
        finally:
            self._stack.pop()
