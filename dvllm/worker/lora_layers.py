"""Many LoRA adapters in one batched forward.

Resident adapters live in a bounded slot table (max_loras slots), one table per adapted Linear layer:
A [slots, max_rank, in] and B [slots, out, max_rank], zero-padded to the largest rank, B already
multiplied by alpha / r. A slot table rather than pages of the state pool: every layer reads whole
adapters every step, and one contiguous table per layer makes a row's adapters one index away.

Each wrapped layer computes base(x) for the whole batch, then, for the rows with adapters only,
    delta[row] = sum over the row's adapters (slot s, weight w) of w * B_s @ A_s @ x[row]
as two batched matmuls over the rows' gathered adapters (the ranks of a row's adapters side by side),
so rows with different adapter sets share the forward and a row pays for its own adapters' ranks only.
Rows without adapters pay nothing past the base layer. Where every adapted row has the same set, the
gather is skipped and two plain matmuls do it.

Layers are wrapped (an instance `forward`) when an adapter first touches them, and pass every call
through unless a forward runs under `LoraLayers.running(...)`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from dvllm.lora.weights import LoraWeights
from dvllm.worker.row_scope import RowScope

RowAdapters = tuple[tuple[int, float], ...]  # one row's adapters: (adapter uid, weight)


class _Table:
    """One adapted layer's slots. A Conv2d layer's A is a conv of the base layer's kernel, stride and padding
    ([slots, R, in, kh, kw], as peft makes it) and its B a 1x1 conv ([slots, out, R])."""

    def __init__(self, module: torch.nn.Module, num_slots: int, rank: int) -> None:
        kw = {"device": module.weight.device, "dtype": module.weight.dtype}
        self.conv = isinstance(module, torch.nn.Conv2d)
        if self.conv:
            self.stride, self.padding = module.stride, module.padding
            self.a = torch.zeros(num_slots, rank, module.in_channels, *module.kernel_size, **kw)
            self.b = torch.zeros(num_slots, module.out_channels, rank, **kw)
        else:
            self.a = torch.zeros(num_slots, rank, module.in_features, **kw)
            self.b = torch.zeros(num_slots, module.out_features, rank, **kw)
        self.filled: set[int] = set()


def _fits(module: Any, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an adapter layer's A and B are made for this module."""
    if isinstance(module, torch.nn.Linear):
        return a.dim() == 2 and a.shape[1] == module.in_features and b.shape[0] == module.out_features
    if isinstance(module, torch.nn.Conv2d):
        return tuple(a.shape[1:]) == (module.in_channels, *module.kernel_size) and b.shape[0] == module.out_channels
    return False


class LoraLayers:
    def __init__(self, pipeline: Any, num_slots: int, max_rank: int, scope: RowScope) -> None:
        self.pipeline, self.num_slots, self.max_rank, self.scope = pipeline, num_slots, max_rank, scope
        self.slot_uid: list[int | None] = [None] * num_slots
        self.slot_rank = [0] * num_slots
        self.tables: dict[tuple[str, str], _Table] = {}
        self.plan: _Plan | None = None
        self._modules: dict[str, dict[str, torch.nn.Module]] = {}

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Puts an adapter into a slot (replacing whoever was there). Checked against the model first, so a
        refused adapter leaves the slot empty rather than half written."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range (max_loras={self.num_slots})")
        targets = []
        for component, layers in weights.layers.items():
            modules = self._named(component)
            for name, (a, b) in layers.items():
                module = modules.get(name)
                if not _fits(module, a, b):
                    raise ValueError(f"LoRA adapter {weights.name!r} does not fit {component}.{name} of this model")
                if a.shape[0] > self.max_rank:
                    raise ValueError(f"LoRA adapter {weights.name!r} has rank {a.shape[0]} > {self.max_rank}")
                targets.append((component, name, module, a, b))
        self.evict(slot)
        for component, name, module, a, b in targets:
            table = self._table(component, name, module)
            r = a.shape[0]
            table.a[slot, :r].copy_(a)
            table.b[slot, :, :r].copy_(b)
            table.filled.add(slot)
        self.slot_uid[slot], self.slot_rank[slot] = weights.uid, weights.rank

    def evict(self, slot: int) -> None:
        for table in self.tables.values():
            if slot in table.filled:
                table.a[slot].zero_()
                table.b[slot].zero_()
                table.filled.discard(slot)
        self.slot_uid[slot], self.slot_rank[slot] = None, 0

    def slot_of(self, uid: int) -> int:
        try:
            return self.slot_uid.index(uid)
        except ValueError:
            raise RuntimeError(f"LoRA adapter #{uid} is not resident on this worker") from None

    @contextmanager
    def running(self, rows: list[RowAdapters]) -> Iterator[None]:
        """A forward whose i-th row (of its first dimension) takes rows[i]'s adapters."""
        if not any(rows):
            yield
            return
        self.plan = _Plan([tuple((self.slot_of(uid), w) for uid, w in row) for row in rows], self)
        try:
            yield
        finally:
            self.plan = None

    def _named(self, component: str) -> dict[str, torch.nn.Module]:
        if component not in self._modules:
            model = getattr(self.pipeline, component, None)
            if not isinstance(model, torch.nn.Module):
                raise ValueError(f"this model has no {component!r} for a LoRA adapter to change")
            self._modules[component] = dict(model.named_modules())
        return self._modules[component]

    def _table(self, component: str, name: str, module: torch.nn.Module) -> _Table:
        key = (component, name)
        if key not in self.tables:
            table = self.tables[key] = _Table(module, self.num_slots, self.max_rank)
            original = module.forward

            def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                out = original(x, *args, **kwargs)
                plan = self.plan
                if plan is None or plan.slots.isdisjoint(table.filled):
                    return out
                return plan.apply(table, x, out)

            module.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
        return self.tables[key]


class _Plan:
    """One forward's rows and their adapters, as slot indices and weights."""

    def __init__(self, rows: list[tuple[tuple[int, float], ...]], layers: LoraLayers) -> None:
        self.num_rows, self.scope = len(rows), layers.scope
        self.slots = {s for row in rows for s, _ in row}
        self.rank = max(layers.slot_rank[s] for s in self.slots)
        k = max(len(row) for row in rows)
        device = next(iter(layers.tables.values())).a.device
        # rows with fewer adapters are padded with slot 0 at weight 0, which adds exact zeros
        self.row_slots = torch.tensor([[s for s, _ in row] + [0] * (k - len(row)) for row in rows], device=device)
        self.row_weights = torch.tensor([[w for _, w in row] + [0.0] * (k - len(row)) for row in rows],
                                        dtype=torch.float32, device=device)
        self.has = [bool(row) for row in rows]
        self.sets = rows
        self._view: tuple[Any, tuple] | None = None

    def _rows(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, bool] | None:
        """(index of the adapted rows among x's, or None for all; their slots; weights; one shared set)."""
        current = self.scope.rows
        if self._view is not None and self._view[0] is current:
            return self._view[1]
        rows = list(range(self.num_rows)) if current is None else current.tolist()
        if len(rows) != n:
            raise RuntimeError(f"a LoRA layer got {n} rows where the forward runs {len(rows)}")
        adapted = [i for i, r in enumerate(rows) if self.has[r]]
        if not adapted:
            view = None
        else:
            chosen = [rows[i] for i in adapted]
            index = torch.tensor(chosen, device=self.row_slots.device)
            shared = len({self.sets[r] for r in chosen}) == 1
            local = None if len(adapted) == n else torch.tensor(adapted, device=self.row_slots.device)
            view = (local, self.row_slots[index], self.row_weights[index], shared)
        self._view = (current, view)
        return view

    def apply(self, table: _Table, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        view = self._rows(x.shape[0])
        if view is None:
            return out
        local, slots, weights, shared = view
        xs = x if local is None else x[local]
        delta = self._conv_delta(table, xs, slots, weights, shared) if table.conv else \
            self._linear_delta(table, xs, slots, weights, shared)
        if local is None:
            return out + delta
        return out.index_add(0, local, delta)

    def _b(self, table: _Table, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The rows' B, each adapter's scaled by its weight, ranks side by side: [rows, out, k * r]."""
        rows, k = slots.shape
        b = table.b[slots, :, :self.rank] * weights.to(table.b.dtype).view(rows, k, 1, 1)
        return b.permute(0, 2, 1, 3).reshape(rows, -1, k * self.rank)

    def _linear_delta(self, table: _Table, xs: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                      shared: bool) -> torch.Tensor:
        r = self.rank
        if shared:  # one set for every adapted row: [k * r, in] and [out, k * r], two plain matmuls
            return (xs @ table.a[slots[0], :r].flatten(0, 1).T) @ self._b(table, slots[:1], weights[:1])[0].T
        rows, k = slots.shape  # per row: [rows, k * r, in] and [rows, out, k * r]
        a = table.a[slots, :r].reshape(rows, k * r, -1)
        h = torch.bmm(xs.reshape(rows, -1, xs.shape[-1]), a.transpose(1, 2))
        return torch.bmm(h, self._b(table, slots, weights).transpose(1, 2)).reshape(*xs.shape[:-1], -1)

    def _conv_delta(self, table: _Table, xs: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                    shared: bool) -> torch.Tensor:
        r, (rows, k) = self.rank, slots.shape
        conv = {"stride": table.stride, "padding": table.padding}
        if shared:
            h = torch.nn.functional.conv2d(xs, table.a[slots[0], :r].flatten(0, 1), **conv)
            b = self._b(table, slots[:1], weights[:1])  # [1, out, k * r]
        else:  # each row its own A: one grouped conv over the rows stacked as channels
            a = table.a[slots, :r].flatten(0, 2)  # [rows * k * r, in, kh, kw]
            h = torch.nn.functional.conv2d(xs.reshape(1, -1, *xs.shape[2:]), a, groups=rows, **conv)
            h = h.view(rows, k * r, *h.shape[2:])
            b = self._b(table, slots, weights)
        delta = torch.bmm(b.expand(rows, -1, -1), h.flatten(2))  # B is a 1x1 conv
        return delta.view(rows, -1, *h.shape[2:])
