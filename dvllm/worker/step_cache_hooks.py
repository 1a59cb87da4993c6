"""Step caching per request inside one batched forward.

diffusers' cache hooks keep one state per transformer and take one decision per call. Here each
request keeps its own state in the state pool and takes its own decision with diffusers' rule, on
exactly the rows the pipeline would decide over (a "group": the request's images, with its CFG rows
where the pipeline batches them, or each CFG branch apart where it calls them apart). Rows that skip
leave the forward, so the skipped blocks run on the other rows only.

- first_block (diffusers' FirstBlockCacheConfig): every row runs the first block. A group whose head
  residual moved, relative to the one its last *computing* step kept, by no more than the threshold
  (mean absolute difference over mean absolute value, over the group's rows) skips: its hidden states
  become the head output plus the tail residual kept from that step. The other rows run the remaining
  blocks as one smaller batch, and the tail block puts the batch back together.
- mag (MagCacheConfig): the decision comes from the model's calibrated ratios before the forward; rows
  that skip run no block at all: their hidden states become their input plus the blocks' residual kept
  from their last computing step.
- taylorseer (TaylorSeerCacheConfig): on the steps its schedule computes, a row's attention modules
  run and refresh their Taylor factors; on the others their outputs are predicted from the factors,
  and those rows leave the attention modules' batch (taylorseer_rows.py).

The hooks are installed once on the adapter's transformer (`CacheHooks`, in diffusers' hook registry, as
diffusers' own cache hooks are) and pass every call through
unless a forward runs under `CacheHooks.running(forward)`: the runner's eager path, since a decision
that depends on the data cannot be replayed from a CUDA graph.
"""
from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook

from dvllm.host_copy import device_index
from dvllm.models.base import CacheSpec
from dvllm.models.layout import BatchLayout
from dvllm.worker.hooked_call import Call
from dvllm.worker.row_scope import RowScope
from dvllm.worker.state_pool import StatePool
from dvllm.worker.step_cache_state import (
    CacheState,
    Group,
    factor_values,
    fit_tokens,
    pool_values,
    stream_tokens,
    write_state,
)
from dvllm.worker.taylorseer_rows import TaylorSeerRows

HOOK_NAME = "dvllm_step_cache"
logger = logging.getLogger(__name__)


class ForwardCache:
    """The cache decisions and state of one batched forward."""

    def __init__(self, spec: CacheSpec, groups: list[Group], num_rows: int, image_tokens: int,
                 row_tokens: list[int] | None = None) -> None:
        self.spec, self.groups, self.num_rows, self.image_tokens = spec, groups, num_rows, image_tokens
        self.row_tokens = row_tokens  # each row's real tokens in the masked stream (spec.mask_arg), from the host
        self.fbc = [g for g in groups if g.state.config.method == "first_block"]
        self.taylor = [g for g in groups if g.state.config.method == "taylorseer"]
        self.mag = [g for g in groups if g.state.config.method == "mag"]
        # A computing group's new state is written over its state (`data`: a view of the pool, see forward_cache):
        # every part of it is read before it is overwritten, and a skipping group never writes. A forward that
        # fails after a write leaves that state half new: it is marked so, and its next step starts it afresh.
        for g in self.mag:  # mag decides before the forward: its measure is the model's calibrated ratios
            g.computes, g.mag_next = g.state.mag_decision()
            if g.computes:
                g.new = g.data
        for g in self.taylor:  # (factors lost to a failed forward: this step refreshes them)
            g.computes = g.state.config.computes(g.step) or not g.state.num_orders
            if g.computes:  # in the factors' own dtype (a view of the same numbers)
                g.new = factor_values(g.data, g.state.config.taylor_factors_dtype)
        self.taylorseer = TaylorSeerRows(spec, self.taylor, image_tokens)
        self.active: torch.Tensor | None = None  # forward rows flowing through the blocks now (None: all)
        self.active_rows: list[int] = list(range(num_rows))  # the same rows, on the host
        self.head_in: torch.Tensor | None = None  # the head block's hidden input, every row
        self.encoder_in: torch.Tensor | None = None
        self.head_out: Any = None  # the head block's output, on the rows that ran it (head_pos: row -> index)
        self.head_pos: dict[int, int] = {}

    # first_block and mag: the blocks
    def head(self, call: Call) -> Any:
        arguments = call.arguments
        hidden_in = arguments[self.spec.hidden_arg]
        self.head_in, self.encoder_in = hidden_in, arguments.get("encoder_hidden_states")
        device = hidden_in.device
        skipping = {r for g in self.mag if not g.computes for r in g.rows}  # these skip every block, the head too
        rows = [r for r in range(self.num_rows) if r not in skipping]
        if skipping:
            self.active, self.active_rows = device_index(rows, device), rows
            if not rows:
                return self._assemble(None)
            out = call.on_rows(self.num_rows, rows, self.active)
        else:
            out = call.run()
        self.head_out, self.head_pos = out, {row: i for i, row in enumerate(rows)}
        if self.fbc:
            skipping |= self._decide_first_block(arguments, hidden_in, rows)
        if not skipping:
            return out
        compute = [r for r in rows if r not in skipping]
        self.active, self.active_rows = device_index(compute, device), compute
        if not compute:  # every row skips: the kept residuals give the blocks' result now
            return self._assemble(None)
        if len(compute) == len(rows):
            return out
        local = device_index([self.head_pos[r] for r in compute], device)
        if self.spec.hidden_index is None:
            return out[local]
        return tuple(o if o is None else o[local] for o in out)

    def _decide_first_block(self, arguments: dict, hidden_in: torch.Tensor, rows: list[int]) -> set[int]:
        """diffusers' first-block decision for each group, on the head's output; returns the rows that skip.
        Every group's measure is computed on the device, and all are read back at once: the step's one wait."""
        device = hidden_in.device
        residual = self._hidden(self.head_out) - (hidden_in if len(rows) == self.num_rows else hidden_in[self.active])
        lengths = None
        if self.spec.mask_arg:  # rows of their own lengths (no mask: every token of every row is real)
            masked = arguments.get(self.spec.mask_arg) is not None
            lengths = [self.row_tokens[r] if masked else residual.shape[1] for r in rows]
        measured = []
        for g in self.fbc:
            local = [self.head_pos[r] for r in g.rows]
            g.local = device_index(local, device)
            if g.state.primed:
                measured.append((g, _measure(residual, local, g.local, self._residual_view(g, g.data, 0), lengths)))
        ratios = torch.stack([m for _, m in measured]).tolist() if measured else []
        for g, ratio in zip((g for g, _ in measured), ratios):
            g.computes = ratio > g.state.config.threshold
        skipping: set[int] = set()
        for g in self.fbc:
            if g.computes:  # (a group not yet primed computes)
                g.new = g.data  # its old head residual was read by the measure above
                write_state(g, self._residual_view(g, g.new, 0), residual[g.local])
            else:
                skipping.update(g.rows)
        return skipping

    def block(self, call: Call, is_tail: bool) -> Any:
        if self.active is None:  # every row computes
            out = call.run()
            if is_tail:
                self._keep_tail(out, list(range(self.num_rows)))
            return out
        if not len(self.active):  # every row skipped at the head, which answered for the blocks
            arguments = call.arguments
            if self.spec.hidden_index is None:
                return arguments[self.spec.hidden_arg]
            out = [None, None]
            out[self.spec.hidden_index] = arguments[self.spec.hidden_arg]
            out[1 - self.spec.hidden_index] = arguments.get("encoder_hidden_states")
            return tuple(out)
        out = call.on_rows(self.num_rows, self.active_rows, self.active)
        if not is_tail:
            return out
        self._keep_tail(out, self.active_rows)
        return self._assemble(out)

    def _keep_tail(self, out: Any, rows: list[int]) -> None:
        """The residuals diffusers keeps at the tail: first_block's, the last block's hidden output minus the
        head block's; mag's, minus the head block's input."""
        position = {row: i for i, row in enumerate(rows)}
        hidden = self._hidden(out)
        for g in self.fbc + self.mag:
            if g.computes:
                local = device_index([position[r] for r in g.rows], hidden.device)
                if g in self.fbc:
                    kept, start = self._residual_view(g, g.new, 1), self._hidden(self.head_out)[g.local]
                else:
                    kept, start = self._residual_view(g, g.new, 0), self.head_in[g.index]
                write_state(g, kept, hidden[local] - start)

    def _assemble(self, computed: Any) -> Any:
        """The batch after the tail: first_block's skipping rows are the head's output plus their kept tail
        residual, mag's the head's input plus their kept residual, the rest what the blocks computed. Of
        the text stream only computed rows are kept: every family served discards it after the last block."""
        h, base = self.spec.hidden_index, self.head_in
        hidden = base.clone()
        for g in self.fbc:
            if not g.computes:
                head = self._hidden(self.head_out)[g.local]
                hidden[g.index] = fit_tokens(self._residual_view(g, g.data, 1), hidden.shape[1]) + head
        for g in self.mag:
            if not g.computes:
                hidden[g.index] = base[g.index] + fit_tokens(self._residual_view(g, g.data, 0), hidden.shape[1])
        if computed is not None:
            hidden[self.active] = self._hidden(computed)
        if h is None:
            return hidden
        result = [None, None]
        result[h] = hidden
        encoder = None if computed is None else computed[1 - h]
        if computed is None or encoder is not None:
            result[1 - h] = self.encoder_in if computed is None else _put(self.encoder_in, encoder, self.active)
        return tuple(result)

    # taylorseer
    def attention(self, module: int, call: Call) -> Any:
        return self.taylorseer.attention(module, call, self.active_rows)

    def _residual_view(self, g: Group, data: torch.Tensor, which: int) -> torch.Tensor:
        """A residual in a group's state, as [rows, tokens, dim]: first_block's 0 is the head's, 1 the
        tail's; mag's 0 is the blocks'."""
        tokens = self._tokens(self.spec.layout.hidden_kind, g)
        size = tokens * self.spec.layout.inner_dim
        return data[:, which * size:(which + 1) * size].view(len(data), tokens, -1)

    def _tokens(self, kind: str, g: Group) -> int:
        """Tokens a row's state keeps for one stream (text: the group's own length; unified: padded parts)."""
        return stream_tokens(self.spec, kind, self.image_tokens, g.text_tokens)

    def _hidden(self, out: Any) -> torch.Tensor:
        return out if self.spec.hidden_index is None else out[self.spec.hidden_index]

    # after the forward and the update succeeded
    def commit(self, write: Callable[[list[list[int]], torch.Tensor], None]) -> list[tuple[CacheState, int, int]]:
        """Writes the computing groups' new state; returns each request's (state, rows skipped, rows computed).
        A step counts as cached for a request when every group of it skipped."""
        by_request: dict[int, list[Group]] = {}
        for g in self.groups:
            by_request.setdefault(id(g.state), []).append(g)
            g.state.written = False  # the forward and the update succeeded: the new state is whole
            if g.computes and not g.in_place:
                write(g.blocks, pool_values(g.new, g.data.dtype))
        outcome = []
        for groups in by_request.values():
            state, computing = groups[0].state, [g for g in groups if g.computes]
            skipped = sum(len(g.rows) for g in groups if not g.computes)
            outcome.append((state, skipped, sum(len(g.rows) for g in computing)))
            if state.config.method == "mag":
                state.advance_mag(bool(computing), groups[0].mag_next)
            elif state.config.method == "first_block":
                state.primed = state.primed or bool(computing)
            elif computing:
                state.num_orders, state.last_update_step = computing[0].new_orders, computing[0].step
        return outcome


class _CacheHook(ModelHook):
    """On one block or attention module (through diffusers' hook registry): the call as the running forward's
    cache decides it, or as it is when no caching forward runs."""

    def __init__(self, hooks: "CacheHooks", decide: Callable) -> None:
        super().__init__()
        self.hooks, self.decide = hooks, decide
        self.signature: inspect.Signature | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)  # read once: Call binds every call's arguments to it
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward, original = self.hooks.current, self.fn_ref.original_forward
        if forward is None:
            return original(*args, **kwargs)
        return self.decide(forward, Call(original, self.signature, args, kwargs, self.hooks.rows))


class CacheHooks:
    """Wraps the spec's blocks and attention modules once; each call consults the running forward."""

    def __init__(self, spec: CacheSpec, rows: RowScope | None = None) -> None:
        self.spec = spec
        self.rows = rows or RowScope()  # shared with whatever else must know which rows a module runs on
        self.current: ForwardCache | None = None
        last = len(spec.blocks) - 1
        for i, block in enumerate(spec.blocks):
            self._wrap(block, lambda f, call, i=i: f.head(call) if i == 0 else f.block(call, i == last))
        for j, module in enumerate(spec.attention):
            self._wrap(module, lambda f, call, j=j: f.attention(j, call))

    def _wrap(self, module: torch.nn.Module, decide: Callable) -> None:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_CacheHook(self, decide), HOOK_NAME)

    @contextmanager
    def running(self, forward: ForwardCache) -> Iterator[None]:
        self.current = forward
        try:
            yield
        finally:
            self.current = None


def _measure(residual: torch.Tensor, rows: list[int], index: torch.Tensor, previous: torch.Tensor,
             lengths: list[int] | None) -> torch.Tensor:
    """The measure of diffusers' FBCHeadBlockHook._should_compute_remaining_blocks on one group's rows (`rows`,
    on the device `index`; with `lengths`, each row's own real tokens only), left on the device."""
    if lengths is None:
        current = residual[index]
    else:  # each row's own tokens, so the measure cannot depend on the batch's padding
        current = torch.cat([residual[r, :lengths[r]] for r in rows])
        previous = torch.cat([previous[i, :lengths[r]] for i, r in enumerate(rows)])
    absmean = (current - previous).abs().mean()
    return absmean / previous.abs().mean()


def _put(full: torch.Tensor, part: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    full = full.clone()
    full[index] = part
    return full


def forward_cache(spec: CacheSpec, pool: StatePool, states: list[Any], layout: BatchLayout) -> ForwardCache:
    """The groups of one forward, its rows as the layout gives them (states in the layout's order). Where the
    family masks its text, each row's real text tokens come from the layout (checked against what the state
    keeps). A group's state is a view of the pool, updated in place (the scheduler gives a request's cache
    state one run of blocks); only blocks that are not one run are read into a copy and written back at
    commit."""
    groups = []
    for s in states:
        if s.cache is not None and s.cache.written:  # its last forward failed after writing part of its state
            logger.warning("request %s: its step cache state was half written by a failed step; starting it "
                           "afresh", s.request_id)
            s.cache.restart()
    text_lengths = layout.row_text_lengths
    for i, s in enumerate(states):
        if s.cache is None:
            continue
        text_tokens = s.cache.text_tokens
        cond, uncond = layout.request_rows(i)
        blocks = s.blocks.cache  # cond rows first, then uncond rows
        if spec.separate_cfg_branches and uncond:
            parts = [(cond, blocks[:s.n]), (uncond, blocks[s.n:])]
        else:
            parts = [(cond + uncond, blocks)]
        for rows, row_blocks in parts:
            longest = max(text_lengths[r] for r in rows) if text_lengths else 0
            if spec.layout.text_bytes_extra is not None and longest > text_tokens:
                raise ValueError(f"step cache: a text of this request has {longest} tokens, more than the "
                                 f"{text_tokens} its cache state was sized for")
            data = pool.view(row_blocks, s.cache.numel)
            in_place = data is not None
            if not in_place:
                data = pool.read(row_blocks, s.cache.numel)
            groups.append(Group(state=s.cache, rows=rows, blocks=row_blocks, step=s.step, text_tokens=text_tokens,
                                data=data, index=device_index(rows, data.device), in_place=in_place))
    image_tokens = spec.layout.image_tokens(*layout.image_size)
    row_tokens = None
    if spec.mask_arg and text_lengths is not None:
        row_tokens = [stream_tokens(spec, spec.layout.hidden_kind, image_tokens, t) for t in text_lengths]
    return ForwardCache(spec, groups, layout.num_rows, image_tokens, row_tokens)
