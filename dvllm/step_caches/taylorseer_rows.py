"""TaylorSeer per request inside one batched forward: the attention modules' part of step caching.

On the steps a request's schedule computes, its rows run each attention module and refresh their Taylor
factors (diffusers' TaylorSeerState.update); on the others their outputs are predicted from the factors
(TaylorSeerState.predict) and those rows leave the module's batch. The factors are views of each request's
state in the pool (step_cache_hooks.forward_cache gives them). The method's driver part is step_caches/taylorseer.py.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dvllm.host_copy import device_index
from dvllm.step_caches.method import MethodRows
from dvllm.step_caches.state import Group, factor_values, fit_tokens, stream_tokens, write_state

Factors = list[list[list[torch.Tensor]]]  # [module][output][order] -> [rows, tokens, dim]


class TaylorSeerRows(MethodRows):
    """The TaylorSeer groups of one forward: their kept factors, and the ones this forward computes."""

    handles_attention = True

    def __init__(self, forward: Any, groups: list[Group]) -> None:
        super().__init__(forward, groups)
        self.spec, self.image_tokens = forward.spec, forward.image_tokens
        for g in groups:  # (factors lost to a failed forward: this step refreshes them)
            g.computes = g.state.config.computes(g.step) or not g.state.host.num_orders
            if g.computes:  # in the factors' own dtype (a view of the same numbers)
                g.new = factor_values(g.data, g.state.config.taylor_factors_dtype)
        self._factors = {id(g): self._views(g, factor_values(g.data, g.state.config.taylor_factors_dtype))
                         for g in groups if g.state.host.num_orders}
        self._new_factors = {id(g): self._views(g, g.new) for g in groups if g.computes}
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def commit(self, state: Any, groups: list[Group]) -> None:
        computing = [g for g in groups if g.computes]
        if computing:
            state.host.num_orders, state.host.last_update_step = computing[0].next, computing[0].step

    def attention(self, module: int, call: Any, rows: list[int]) -> Any:
        """One attention module's call (worker/hooked_call.Call) on the forward rows `rows` that flow through the
        blocks now."""
        position = {row: i for i, row in enumerate(rows)}
        predicting = [g for g in self.groups if not g.computes and g.rows[0] in position]
        if not predicting:
            out = call.run()
            self._refresh(module, rows, out)
            return out
        arguments = call.arguments
        hidden = arguments["hidden_states"]
        kinds = self.spec.attention_kinds[module]
        tokens = {"image": hidden.shape[1], "joint": hidden.shape[1], "unified": hidden.shape[1]}
        if "text" in kinds:
            tokens["text"] = arguments["encoder_hidden_states"].shape[1]
        outputs = [hidden.new_empty((len(rows), tokens[k], hidden.shape[2])) for k in kinds]
        skip = {position[r] for g in predicting for r in g.rows}
        compute = [i for i in range(len(rows)) if i not in skip]
        if compute:
            index = self._index(compute, hidden.device)
            computed = call.on_rows(len(rows), compute, index)
            self._refresh(module, [rows[i] for i in compute], computed)
            for o, c in zip(outputs, _as_tuple(computed)):
                o[index] = c
        for g in predicting:
            local = self._index([position[r] for r in g.rows], hidden.device)
            for o, predicted in zip(outputs, self._predict(module, g, hidden.dtype)):
                o[local] = fit_tokens(predicted, o.shape[1])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _refresh(self, module: int, rows: list[int], out: Any) -> None:
        """diffusers' TaylorSeerState.update, for each group computing this step, on its rows of `out`."""
        position = {row: i for i, row in enumerate(rows)}
        for g in self.groups:
            if not g.computes or g.rows[0] not in position:
                continue
            old, new = self._factors.get(id(g)), self._new_factors[id(g)]
            factor_dtype = getattr(torch, g.state.config.taylor_factors_dtype)
            local = None
            for o, features in enumerate(_as_tuple(out)):
                if local is None:
                    local = self._index([position[r] for r in g.rows], features.device)
                factors = [fit_tokens(features[local], new[module][o][0].shape[1])]
                if g.state.host.last_update_step is not None:
                    delta = g.step - g.state.host.last_update_step
                    for j in range(min(g.state.config.max_order, g.state.host.num_orders)):
                        factors.append((factors[j] - old[module][o][j].to(features.dtype)) / delta)
                for k, factor in enumerate(factors):  # kept in the factors' dtype, as diffusers keeps them
                    write_state(g, new[module][o][k], factor.to(factor_dtype))
                g.next = len(factors)  # the factors the refresh produced

    def _predict(self, module: int, g: Group, dtype: torch.dtype) -> list[torch.Tensor]:
        """diffusers' TaylorSeerState.predict: the series at this step's offset from the last refresh."""
        offset = g.step - g.state.host.last_update_step
        outputs = []
        for factors in self._factors[id(g)][module]:
            result = factors[0].to(dtype)  # diffusers starts from zeros and adds the order-0 factor times 1.0
            for order in range(1, g.state.host.num_orders):
                result = result + factors[order].to(dtype) * ((offset ** order) / math.factorial(order))
            outputs.append(result)
        return outputs

    def _views(self, g: Group, values: torch.Tensor) -> Factors:
        """A group's factors (in their own dtype) as [module][output][order] views of its state."""
        dim, orders = self.spec.layout.inner_dim, g.state.config.max_order + 1
        views, start = [], 0
        for kinds in self.spec.attention_kinds:
            module = []
            for kind in kinds:
                tokens = stream_tokens(self.spec, kind, self.image_tokens, g.text_tokens)
                size = tokens * dim
                module.append([values[:, start + k * size:start + (k + 1) * size].view(len(g.rows), tokens, dim)
                               for k in range(orders)])
                start += orders * size
            views.append(module)
        return views

    def _index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """`rows` on the device, copied once per forward: every attention module asks for the same few sets."""
        key = tuple(rows)
        if key not in self._indices:
            self._indices[key] = device_index(rows, device)
        return self._indices[key]


def _as_tuple(out: Any) -> tuple:
    return (out,) if torch.is_tensor(out) else tuple(out)
