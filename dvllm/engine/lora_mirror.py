"""Adapters cross the engine core's pipe once, not with every request.

A request carries its adapters' weights (read where it was checked). Sent as they are, a 200 MB adapter
would be pickled, piped and unpickled again for every request that names it, beside the core's step
loop. Instead both ends keep the same least-recently-used table of adapters (by load uid, which a reload
changes), updated in the same order because commands cross the pipe in order: the server sends weights
the core's table lacks and a reference to those it holds.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

from dvllm.core.request import Request
from dvllm.lora.weights import LoraWeights


@dataclass(frozen=True)
class LoraRef:
    """An adapter the core already holds."""

    uid: int


class LoraMirror:
    """One end's table: `outgoing` on the server's, `incoming` on the core's; `capacity` on both alike."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._table: OrderedDict[int, LoraWeights] = OrderedDict()

    def outgoing(self, request: Request) -> Request:
        """The request to send: a copy whose adapters the core holds are references."""
        if not request.loras:
            return request
        loras = []
        for weights, weight in request.loras:
            held = weights.uid in self._table
            self._touch(weights)
            loras.append((LoraRef(weights.uid) if held else weights, weight))
        sent = copy.copy(request)
        sent.loras = tuple(loras)
        return sent

    def incoming(self, request: Request) -> Request:
        """The request as the server had it: references replaced by the weights they name."""
        if not request.loras:
            return request
        loras = []
        for weights, weight in request.loras:
            if isinstance(weights, LoraRef):
                weights = self._table[weights.uid]
            self._touch(weights)
            loras.append((weights, weight))
        request.loras = tuple(loras)
        return request

    def _touch(self, weights: LoraWeights) -> None:
        self._table[weights.uid] = weights
        self._table.move_to_end(weights.uid)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)

    def __len__(self) -> int:
        return len(self._table)
