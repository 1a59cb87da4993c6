"""Many LoRA adapters in one batched forward.

Resident adapters live in a bounded slot table (max_loras slots), one table per adapted Linear or Conv2d
layer: A [slots, max_rank, in] and B transposed [slots, max_rank, out], zero-padded to the largest rank,
B already multiplied by alpha / r; a Linear layer that an adapter gives B a bias (LightX2V's Wan LoRAs) also gets
a table of biases [slots, out], times alpha / r. A slot table rather than pages of the state pool: every layer
reads whole adapters every step, and one contiguous table per layer makes a row's adapters one index away.

Each wrapped layer computes base(x) for the whole batch, then, for the rows with adapters only, adds
    sum over the row's adapters (slot s, weight w) of w * (B_s @ A_s @ x[row] + bias_s)
in place, as two batched matmuls over the rows' gathered adapters (the ranks of a row's adapters side by
side; the second one accumulates into the output), so rows with different adapter sets share the forward
and a row pays for its own adapters' ranks only. Rows without adapters pay nothing past the base layer.
Where every adapted row has the same set, there is no per-row gather: two plain matmuls do it.

Layers get a hook in diffusers' hook registry (as its own caches do) when an adapter first touches them,
and pass every call through unless a forward's context (worker/forward_context.py) with a LoRA plan is given
to them: `LoraLayers.context` makes one for a text-encoder call, the denoiser's forward its own.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook

from dvllm.host_copy import device_index, device_tensor, to_device
from dvllm.lora.weights import LoraWeights
from dvllm.models.layout import RowAdapters
from dvllm.worker.forward_context import TEXT_ENCODERS, ForwardContext, ForwardHooks, part_of
from dvllm.worker.row_scope import RowScope

HOOK_NAME = "dvllm_lora"


class _Table:
    """One adapted layer's slots: A [slots, R, in] and B transposed, [slots, R, out], so that one index
    gives a row's adapters with their ranks side by side. A Conv2d layer's A is a conv of the base layer's
    kernel, stride and padding ([slots, R, in, kh, kw], as peft makes it); its B is a 1x1 conv."""

    def __init__(self, module: torch.nn.Module, num_slots: int, rank: int) -> None:
        kw = {"device": module.weight.device, "dtype": module.weight.dtype}
        self.conv = isinstance(module, torch.nn.Conv2d)
        if self.conv:
            self.stride, self.padding = module.stride, module.padding
            self.a = torch.zeros(num_slots, rank, module.in_channels, *module.kernel_size, **kw)
            self.bt = torch.zeros(num_slots, rank, module.out_channels, **kw)
        else:
            self.a = torch.zeros(num_slots, rank, module.in_features, **kw)
            self.bt = torch.zeros(num_slots, rank, module.out_features, **kw)
        self.filled: set[int] = set()
        # B's biases [slots, out], made when the first adapter with one is loaded (zeros for the others)
        self.bias: torch.Tensor | None = None
        self.biased: set[int] = set()

    def set_bias(self, slot: int, bias: torch.Tensor) -> None:
        if self.bias is None:
            self.bias = self.bt.new_zeros(self.bt.shape[0], self.bt.shape[2])
        self.bias[slot].copy_(bias)
        self.biased.add(slot)


def _fits(module: Any, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether an adapter layer's A, B and B's bias (Linear layers only) are made for this module."""
    if isinstance(module, torch.nn.Linear):
        return a.dim() == 2 and a.shape[1] == module.in_features and b.shape[0] == module.out_features \
            and (bias is None or tuple(bias.shape) == (module.out_features,))
    if bias is not None:
        return False
    if isinstance(module, torch.nn.Conv2d):
        return tuple(a.shape[1:]) == (module.in_channels, *module.kernel_size) and b.shape[0] == module.out_channels
    return False


class LoraLayers:
    def __init__(self, pipeline: Any, num_slots: int, max_rank: int, hooks: ForwardHooks) -> None:
        self.pipeline, self.num_slots, self.max_rank, self.hooks = pipeline, num_slots, max_rank, hooks
        self.slot_digest: list[str | None] = [None] * num_slots  # each slot's adapter, by file digest
        self.slot_rank = [0] * num_slots
        self.tables: dict[tuple[str, str], _Table] = {}
        self._coverage_ids: dict[frozenset, int] = {}
        self._modules: dict[str, dict[str, torch.nn.Module]] = {}

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Puts an adapter into a slot (replacing whoever was there). Checked against the model first, so a
        refused adapter leaves the slot empty rather than half written."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range (max_loras={self.num_slots})")
        targets = []
        for component, layers in weights.layers.items():
            modules = self._named(component)
            biases = weights.biases.get(component, {})
            for name, (a, b) in layers.items():
                module, bias = modules.get(name), biases.get(name)
                if not _fits(module, a, b, bias):
                    raise ValueError(f"LoRA adapter {weights.name!r} does not fit {component}.{name} of this model")
                targets.append((component, name, module, a, b, bias))
        self.evict(slot)
        for component, name, module, a, b, bias in targets:
            table = self._table(component, name, module)
            r = a.shape[0]
            table.a[slot, :r].copy_(a)
            table.bt[slot, :r].copy_(b.T)
            table.filled.add(slot)
            if bias is not None:
                table.set_bias(slot, bias)
        self.slot_digest[slot], self.slot_rank[slot] = weights.digest, weights.rank

    def evict(self, slot: int) -> None:
        for table in self.tables.values():
            if slot in table.filled:
                table.a[slot].zero_()
                table.bt[slot].zero_()
                table.filled.discard(slot)
            if slot in table.biased:
                table.bias[slot].zero_()
                table.biased.discard(slot)
        self.slot_digest[slot], self.slot_rank[slot] = None, 0

    def slot_of(self, digest: str) -> int:
        try:
            return self.slot_digest.index(digest)
        except ValueError:
            raise RuntimeError(f"LoRA adapter {digest} is not resident on this worker") from None

    def plan(self, rows: tuple[RowAdapters, ...] | list[RowAdapters]) -> "LoraPlan | None":
        """A forward whose i-th row (of its first dimension) takes rows[i]'s adapters (None: no row has any)."""
        if not any(rows):
            return None
        return LoraPlan([tuple((self.slot_of(digest), w) for digest, w in row) for row in rows], self)

    @contextmanager
    def encoding(self, rows: tuple[RowAdapters, ...] | list[RowAdapters]) -> Iterator[None]:
        """The text encoders' adapted layers apply `rows`' adapters to the calls inside (one text a row)."""
        plan = self.plan(rows)
        with self.hooks.running(None if plan is None else ForwardContext(lora=plan), TEXT_ENCODERS):
            yield

    def coverage(self, slots: set[int]) -> tuple[int, ...]:
        """Which layers the adapters in `slots` change, and where they add a bias, as a short key: adapters made
        for one model mostly change the same layers, so forwards with different adapters share a captured graph."""
        ids = set()
        for slot in slots:
            layers = frozenset((key, slot in table.biased) for key, table in self.tables.items()
                               if slot in table.filled)
            ids.add(self._coverage_ids.setdefault(layers, len(self._coverage_ids)))
        return tuple(sorted(ids))

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
            hook = _LoraHook(table)
            _register_innermost(module, hook)
            self.hooks.add(part_of(component), hook)
        return self.tables[key]


def _register_innermost(module: torch.nn.Module, hook: "_LoraHook") -> None:
    """The LoRA hook adds to the layer's own output, computed from its own input: hooks already on the layer are
    put back around it (as around peft's LoRA layer, which replaces the module they hook). A group member's sequence-parallel plan gathers Wan's proj_out output over the members'
    tokens in a hook of that layer (parallel/uneven_split.py); outside it, the LoRA update of the member's tokens
    met the gathered output (a LoRA on the head, as LightX2V's, failed every row)."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    outer = list(registry.hooks.items())  # in registration order, innermost first
    for name, _ in reversed(outer):
        registry.remove_hook(name, recurse=False)
    registry.register_hook(hook, HOOK_NAME)
    for name, other in outer:
        registry.register_hook(other, name)


class _LoraHook(ModelHook):
    """On one adapted layer (through diffusers' hook registry): the base layer, then the rows' updates, as the
    forward's context (given for its span: ForwardHooks) plans them."""

    def __init__(self, table: _Table) -> None:
        super().__init__()
        self.table = table
        self.context: ForwardContext | None = None

    def new_forward(self, module: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.fn_ref.original_forward(x, *args, **kwargs)
        context = self.context
        plan = None if context is None else context.lora
        if plan is None or plan.slots.isdisjoint(self.table.filled):
            return out
        return plan.apply(self.table, x, out, context)


@dataclass
class _View:
    """The adapted rows of one layer call and what they take."""

    local: torch.Tensor | None  # their index among the call's rows (None: all rows)
    slots: torch.Tensor         # [rows, k] each row's adapters' slots
    scale: torch.Tensor         # [rows, k * r] each adapter's weight, repeated over its rank
    shared: bool                # every adapted row has the same set: one A and B for all


class LoraPlan:
    """One forward's rows and their adapters, as slot indices and weights. A layer adds, to the adapted
    rows of its output, (x @ A_rows^T * weights) @ B_rows: ranks of a row's adapters side by side, rows with
    fewer adapters padded with slot 0 at weight 0 (exact zeros), ranks cut to the largest in the batch.

    What a layer does is fixed by `graph_key` (which rows are adapted, whether they share one set, the rank,
    adapters per row, the layers changed); the slots and weights are data in two device tables, so a CUDA
    graph captured with one plan replays another of the same key once `take_values` copied its tables."""

    def __init__(self, rows: list[tuple[tuple[int, float], ...]], layers: LoraLayers) -> None:
        self.num_rows, self.layers = len(rows), layers
        self.slots = {s for row in rows for s, _ in row}
        self.rank = max(layers.slot_rank[s] for s in self.slots)
        k = max(len(row) for row in rows)
        self.device = next(iter(layers.tables.values())).a.device
        self.row_slots = device_tensor([[s for s, _ in row] + [0] * (k - len(row)) for row in rows], self.device)
        scale = torch.tensor([[w for _, w in row] + [0.0] * (k - len(row)) for row in rows], dtype=torch.float32)
        self.row_scale = to_device(scale.repeat_interleave(self.rank, dim=1), self.device)
        self.has = [bool(row) for row in rows]
        self.sets = rows
        adapted = [r for r in range(self.num_rows) if self.has[r]]
        # every row of the forward (no step caching narrowing it): its index made here, not inside the forward
        index = device_index(adapted, self.device)  # (the adapted rows among all: both which and where)
        self._all = (adapted, index, None if len(adapted) == self.num_rows else index)
        shared = len({rows[r] for r in adapted}) == 1
        self.graph_key = (tuple(self.has), shared, self.rank, k, layers.coverage(self.slots))

    def take_values(self, other: "LoraPlan") -> None:
        """Another plan's slots and weights into this one's tables (plans of one graph_key)."""
        if other is not self:
            self.row_slots.copy_(other.row_slots, non_blocking=True)
            self.row_scale.copy_(other.row_scale, non_blocking=True)

    def _rows(self, n: int, dtype: torch.dtype, scope: RowScope, memo: dict) -> _View | None:
        """The call's adapted rows: the forward's rows, or those `scope` runs now (step caching, per-shape calls),
        computed once per row set and dtype in the forward's `memo` (every layer of the forward asks; a new
        forward, a captured graph's too, builds them anew from the tables)."""
        current = scope.rows
        cached = memo.get((self, dtype))
        if cached is not None and cached[0] == current:  # (step caching narrows each module's call anew)
            return cached[1]
        rows = list(range(self.num_rows)) if current is None else current
        if len(rows) != n:
            raise RuntimeError(f"a LoRA layer got {n} rows where the forward runs {len(rows)}")
        view = None
        if current is None:
            adapted, index, local = self._all
        else:
            adapted = [i for i, r in enumerate(rows) if self.has[r]]
            chosen = [rows[i] for i in adapted]
            index = device_index(chosen, self.device) if adapted else None
            local = None if len(adapted) == n else device_index(adapted, self.device)
        if adapted:
            view = _View(local=local, slots=self.row_slots[index], scale=self.row_scale[index].to(dtype),
                         shared=len({self.sets[rows[i]] for i in adapted}) == 1)
        memo[(self, dtype)] = (current, view)
        return view

    def apply(self, table: _Table, x: torch.Tensor, out: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """`out` (the base layer's fresh output) with the rows' low-rank updates added in place."""
        view = self._rows(x.shape[0], out.dtype, context.rows, context.memo)
        if view is None:
            return out
        out = out if out.is_contiguous() else out.contiguous()
        xs = x if view.local is None else x[view.local]
        if table.conv:
            self._add_conv(table, xs, out, view)
        else:
            self._add_linear(table, xs, out, view)
        return out

    def _add_linear(self, table: _Table, xs: torch.Tensor, out: torch.Tensor, view: _View) -> None:
        r, width = self.rank, xs.shape[-1]
        # the plan's adapters add a bias here (known on the host: graph_key's coverage says so too)
        biased = table.bias is not None and not self.slots.isdisjoint(table.biased)
        if view.shared:  # [k * r, in] and [k * r, out] for every row: two plain matmuls
            a, bt = table.a[view.slots[0], :r].flatten(0, 1), table.bt[view.slots[0], :r].flatten(0, 1)
            h = xs.reshape(-1, width) @ a.T
            h *= view.scale[0]
            bias = view.scale[0, ::r] @ table.bias[view.slots[0]] if biased else None  # [out]: sum of w * bias
            if view.local is None:
                out.view(-1, bt.shape[1]).addmm_(h, bt)
                if bias is not None:
                    out += bias
            else:
                delta = (h @ bt).view(*xs.shape[:-1], -1)
                if bias is not None:
                    delta += bias
                out.index_add_(0, view.local, delta)
            return
        rows, k = view.slots.shape  # per row: [rows, k * r, in] and [rows, k * r, out], batched matmuls
        a = table.a[view.slots, :r].reshape(rows, k * r, width)
        bt = table.bt[view.slots, :r].reshape(rows, k * r, -1)
        h = torch.bmm(xs.reshape(rows, -1, width), a.transpose(1, 2))
        h *= view.scale.unsqueeze(1)
        # [rows, 1, out]: each row's sum of w * bias over its adapters
        bias = torch.bmm(view.scale[:, ::r].unsqueeze(1), table.bias[view.slots]) if biased else None
        if view.local is None:
            by_row = out.view(rows, -1, bt.shape[2])
            by_row.baddbmm_(h, bt)
            if bias is not None:
                by_row += bias
        else:
            delta = torch.bmm(h, bt)
            if bias is not None:
                delta += bias
            out.index_add_(0, view.local, delta.view(*xs.shape[:-1], -1))

    def _add_conv(self, table: _Table, xs: torch.Tensor, out: torch.Tensor, view: _View) -> None:
        r, (rows, k) = self.rank, view.slots.shape
        conv = {"stride": table.stride, "padding": table.padding}
        if view.shared:
            h = torch.nn.functional.conv2d(xs, table.a[view.slots[0], :r].flatten(0, 1), **conv)
            h *= view.scale[0].view(1, -1, 1, 1)
            bt = table.bt[view.slots[0], :r].flatten(0, 1).expand(rows, -1, -1)
        else:  # each row its own A: one grouped conv over the rows stacked as channels
            a = table.a[view.slots, :r].flatten(0, 2)  # [rows * k * r, in, kh, kw]
            h = torch.nn.functional.conv2d(xs.reshape(1, -1, *xs.shape[2:]), a, groups=rows, **conv)
            h = h.view(rows, k * r, *h.shape[2:])
            h *= view.scale.view(rows, -1, 1, 1)
            bt = table.bt[view.slots, :r].reshape(rows, k * r, -1)
        h = h.flatten(2)  # B is a 1x1 conv: [rows, out, k * r] @ [rows, k * r, pixels]
        if view.local is None:
            out.view(rows, out.shape[1], -1).baddbmm_(bt.transpose(1, 2), h)
        else:
            out.index_add_(0, view.local, torch.bmm(bt.transpose(1, 2), h).view(rows, *out.shape[1:]))
