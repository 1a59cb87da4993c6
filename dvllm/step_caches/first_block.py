"""first_block: diffusers' FirstBlockCacheConfig, per request.

Every row runs the first block. A group whose head residual moved, relative to the one its last *computing*
step kept, by no more than the threshold (mean absolute difference over mean absolute value, over the
group's rows) skips: its hidden states become the head output plus the tail residual kept from that step.
The other rows run the remaining blocks as one smaller batch, and the tail block puts the batch back together.
"""
from __future__ import annotations

from typing import Any, Callable

from dvllm.step_caches.method import CacheMethod, MethodRows, check_threshold, hidden_residuals


class FirstBlock(CacheMethod):
    name = "first_block"
    fields = {"threshold": 0.05}  # FirstBlockCacheConfig's default

    def check(self, config: Any, given: set[str]) -> Any:
        return check_threshold(config, "threshold", given)

    def row_numel(self, config: Any, layout: Any, tokens: Callable[[str], int]) -> int:
        return hidden_residuals(2, layout, tokens)  # the head block's last computed residual, the tail's

    def diffusers_config(self, config: Any) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=config.threshold)

    def rows(self, forward: Any, groups: list) -> MethodRows:
        return FirstBlockRows(forward, groups)


class FirstBlockRows(MethodRows):
    def after_head(self, arguments: dict, hidden_in: Any, rows: list[int]) -> set[int]:
        """diffusers' first-block decision for each group, on the head's output; returns the rows that skip.
        Every group's measure is computed on the device, and all are read back at once: the step's one wait."""
        import torch

        from dvllm.host_copy import device_index
        from dvllm.step_caches.state import write_state

        f = self.forward
        device = hidden_in.device
        residual = f.hidden(f.head_out) - (hidden_in if len(rows) == f.num_rows else hidden_in[f.active])
        lengths = None
        if f.spec.mask_arg:  # rows of their own lengths (no mask: every token of every row is real)
            masked = arguments.get(f.spec.mask_arg) is not None
            lengths = [f.row_tokens[r] if masked else residual.shape[1] for r in rows]
        measured = []
        for g in self.groups:
            local = [f.head_pos[r] for r in g.rows]
            g.local = device_index(local, device)
            if g.state.primed:
                measured.append((g, _measure(residual, local, g.local, f.residual_view(g, g.data, 0), lengths)))
        ratios = torch.stack([m for _, m in measured]).tolist() if measured else []
        for g, ratio in zip((g for g, _ in measured), ratios):
            g.computes = ratio > g.state.config.threshold
        skipping: set[int] = set()
        for g in self.groups:
            if g.computes:  # (a group not yet primed computes)
                g.new = g.data  # its old head residual was read by the measure above
                write_state(g, f.residual_view(g, g.new, 0), residual[g.local])
            else:
                skipping.update(g.rows)
        return skipping

    def keep(self, hidden: Any, position: dict[int, int]) -> None:
        """diffusers keeps the last block's hidden output minus the head block's."""
        from dvllm.host_copy import device_index
        from dvllm.step_caches.state import write_state

        f = self.forward
        for g in self.groups:
            if g.computes:
                local = device_index([position[r] for r in g.rows], hidden.device)
                write_state(g, f.residual_view(g, g.new, 1), hidden[local] - f.hidden(f.head_out)[g.local])

    def fill(self, hidden: Any) -> None:
        """A skipping group's rows: the head's output plus their kept tail residual."""
        from dvllm.step_caches.state import fit_tokens

        f = self.forward
        for g in self.groups:
            if not g.computes:
                head = f.hidden(f.head_out)[g.local]
                hidden[g.index] = fit_tokens(f.residual_view(g, g.data, 1), hidden.shape[1]) + head

    def commit(self, state: Any, groups: list) -> None:
        state.primed = state.primed or any(g.computes for g in groups)


def _measure(residual: Any, rows: list[int], index: Any, previous: Any, lengths: list[int] | None) -> Any:
    """The measure of diffusers' FBCHeadBlockHook._should_compute_remaining_blocks on one group's rows (`rows`,
    on the device `index`; with `lengths`, each row's own real tokens only), left on the device."""
    import torch

    if lengths is None:
        current = residual[index]
    else:  # each row's own tokens, so the measure cannot depend on the batch's padding
        current = torch.cat([residual[r, :lengths[r]] for r in rows])
        previous = torch.cat([previous[i, :lengths[r]] for i, r in enumerate(rows)])
    absmean = (current - previous).abs().mean()
    return absmean / previous.abs().mean()
