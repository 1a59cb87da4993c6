"""The part of a forward that methods which skip every block share (mag, teacache): a computing row keeps the
blocks' residual (the last block's hidden output minus the first block's input), a skipping row's hidden
states are its input plus that residual."""
from __future__ import annotations

from typing import Any, ClassVar

from dvllm.step_caches.method import MethodRows


class BlocksResidualRows(MethodRows):
    skips_head = True
    residual_slot: ClassVar[int] = 0  # which hidden-stream tensor of a row's state holds the residual

    def keep(self, hidden: Any, position: dict[int, int]) -> None:
        from dvllm.host_copy import device_index
        from dvllm.step_caches.state import write_state

        f = self.forward
        for g in self.groups:
            if g.computes:
                local = device_index([position[r] for r in g.rows], hidden.device)
                write_state(g, f.residual_view(g, g.new, self.residual_slot), hidden[local] - f.head_in[g.index])

    def fill(self, hidden: Any) -> None:
        from dvllm.step_caches.state import fit_tokens

        f = self.forward
        for g in self.groups:
            if not g.computes:
                kept = f.residual_view(g, g.data, self.residual_slot)
                hidden[g.index] = f.head_in[g.index] + fit_tokens(kept, hidden.shape[1])
