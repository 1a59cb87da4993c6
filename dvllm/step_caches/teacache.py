"""teacache: TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache for Video Diffusion
Model"; reference: ali-vilab/TeaCache, TeaCache4FLUX), per request.

Each step, a request's modulated input (the first block's norm1 of the blocks' hidden input with the timestep
embedding) is compared with the previous step's: the relative L1 distance (mean |cur - prev| over mean
|prev|, over the request's rows), rescaled by the model's fitted polynomial, is accumulated. The first and
last steps, and a step where the sum reaches `rel_l1_thresh`, compute every block (the sum starts again from
0) and keep the blocks' residual (their hidden output minus their input); the other steps skip every block
and add the kept residual. diffusers has no TeaCache hook: the reference is the test's own loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dvllm.step_caches.blocks_residual import BlocksResidualRows
from dvllm.step_caches.method import CacheMethod, MethodRows, check_threshold, finite, hidden_residuals, show_value

# The rescaling polynomials the TeaCache authors fitted, highest degree first (np.poly1d's order), by family.
# Published for FLUX.1; Wan 2.1's are fitted on the timestep embedding instead of a modulated input, which
# this hook does not take, so Wan is not served.
COEFFICIENTS = {"flux": (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01)}
MAX_COEFFICIENTS = 10


@dataclass
class TeaState:
    accumulated: float = 0.0  # the rescaled distances summed since the last computing step


class TeaCache(CacheMethod):
    name = "teacache"
    # rel_l1_thresh: the reference's (0.25: about 1.5x on FLUX.1-dev); coefficients: None, the model's
    fields = {"rel_l1_thresh": 0.25, "coefficients": None}
    in_diffusers = False

    def check(self, config: Any, given: set[str]) -> Any:
        config = check_threshold(config, "rel_l1_thresh", given)
        value = config.coefficients
        if value is None:
            return config
        listed = isinstance(value, (list, tuple)) and len(value) <= MAX_COEFFICIENTS
        numbers = tuple(map(finite, value)) if listed else ()
        if not 0 < len(numbers) <= MAX_COEFFICIENTS or None in numbers:
            raise ValueError(f"cache.coefficients must be a list of 1 to {MAX_COEFFICIENTS} finite numbers (a "
                             f"polynomial, highest degree first) or null for the model's, got {show_value(value)}")
        return config.replace(coefficients=numbers)

    def unsupported(self, info: Any) -> str | None:
        if info.family in COEFFICIENTS:
            return None
        return (f"cache.method: teacache is not served for the {info.family} family (it is for "
                f"{', '.join(sorted(COEFFICIENTS))}: the families whose first block's norm1 it reads)")

    def for_model(self, config: Any, info: Any) -> Any:
        return config if config.coefficients is not None else config.replace(coefficients=COEFFICIENTS[info.family])

    def row_numel(self, config: Any, layout: Any, tokens: Callable[[str], int]) -> int:
        return hidden_residuals(2, layout, tokens)  # the last step's modulated input, the blocks' residual

    def host_state(self, config: Any) -> TeaState:
        return TeaState()

    def rows(self, forward: Any, groups: list) -> MethodRows:
        return TeaCacheRows(forward, groups)


class TeaCacheRows(BlocksResidualRows):
    residual_slot = 1  # after the last step's modulated input

    def before_head(self, call: Any) -> None:
        """Each group's decision from its own modulated input; every group keeps its new one."""
        import numpy as np
        import torch

        from dvllm.host_copy import device_index
        from dvllm.step_caches.state import write_state

        f, arguments = self.forward, call.arguments
        hidden = arguments[f.spec.hidden_arg]
        rows = [r for g in self.groups for r in g.rows]
        index = device_index(rows, hidden.device)
        with call.rows.narrow(rows, index):  # (LoRA layers in norm1 must know which rows they run on)
            modulated = f.spec.blocks[0].norm1(hidden[index], emb=arguments["temb"][index])[0]
        start, measured = 0, []
        for g in self.groups:
            g.new, mine = g.data, modulated[start:start + len(g.rows)]
            start += len(g.rows)
            g.computes = not g.state.primed or g.step in (0, g.num_steps - 1)
            if not g.computes:
                previous = f.residual_view(g, g.data, 0)
                measured.append((g, (mine - previous).abs().mean() / previous.abs().mean()))
            write_state(g, f.residual_view(g, g.new, 0), mine)  # after the measure read the previous one
        distances = torch.stack([m for _, m in measured]).tolist() if measured else []
        for (g, _), distance in zip(measured, distances):
            g.next = g.state.host.accumulated + np.poly1d(g.state.config.coefficients)(distance)
            g.computes = g.next >= g.state.config.rel_l1_thresh
        for g in self.groups:
            if g.computes:
                g.next = 0.0

    def commit(self, state: Any, groups: list) -> None:
        state.host.accumulated = groups[0].next
        state.primed = state.primed or any(g.computes for g in groups)
