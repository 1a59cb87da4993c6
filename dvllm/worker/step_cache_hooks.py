"""Step caching per request inside one batched forward.

diffusers' cache hooks keep one state per transformer and take one decision per call. Here each
request keeps its own state in the state pool and takes its own decision with its method's rule, on
exactly the rows the pipeline would decide over (a "group": the request's images, with its CFG rows
where the pipeline batches them, or each CFG branch apart where it calls them apart). Rows that skip
leave the forward, so the skipped blocks run on the other rows only.

ForwardCache runs the parts every method shares (which rows run the first block, the blocks after it
and each attention module; the batch put back together after the last block); each method's module
(dvllm/step_caches/, by the registry) decides for its groups, keeps their state and fills their skipped
rows (its MethodRows).

The hooks are installed once on the adapter's transformer (`CacheHooks`, in diffusers' hook registry, as
diffusers' own cache hooks are) and pass every call through unless a forward's context with a ForwardCache is
given to them (worker/forward_context.py): the runner's eager path, since a decision that depends on the data
cannot be replayed from a CUDA graph.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from dvllm.host_copy import device_index
from dvllm.models.base import CacheSpec
from dvllm.models.layout import BatchLayout
from dvllm.step_caches.method import MethodRows
from dvllm.step_caches.registry import method_of
from dvllm.step_caches.state import CacheState, Group, pool_values, stream_tokens
from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks
from dvllm.worker.hooked_call import Call
from dvllm.worker.state_pool import StatePool

HOOK_NAME = "dvllm_step_cache"
logger = logging.getLogger(__name__)


class ForwardCache:
    """The cache decisions and state of one batched forward."""

    def __init__(self, spec: CacheSpec, groups: list[Group], num_rows: int, image_tokens: int,
                 row_tokens: list[int] | None = None) -> None:
        self.spec, self.groups, self.num_rows, self.image_tokens = spec, groups, num_rows, image_tokens
        self.row_tokens = row_tokens  # each row's real tokens in the masked stream (spec.mask_arg), from the host
        self.active: torch.Tensor | None = None  # forward rows flowing through the blocks now (None: all)
        self.active_rows: list[int] = list(range(num_rows))  # the same rows, on the host
        self.head_in: torch.Tensor | None = None  # the head block's hidden input, every row
        self.encoder_in: torch.Tensor | None = None
        self.head_out: Any = None  # the head block's output, on the rows that ran it (head_pos: row -> index)
        self.head_pos: dict[int, int] = {}
        # A computing group's new state is written over its state (`data`: a view of the pool, see forward_cache):
        # every part of it is read before it is overwritten. A forward that fails after a write leaves that state
        # half new: it is marked so, and its next step starts it afresh. Decisions taken before the forward
        # are taken here, as each method's part is made.
        by_method: dict[str, list[Group]] = {}
        for g in groups:
            by_method.setdefault(g.state.config.method, []).append(g)
        self.parts: dict[str, MethodRows] = {name: method_of(name).rows(self, of_method)
                                             for name, of_method in by_method.items()}
        self.attending = [p for p in self.parts.values() if p.handles_attention]

    # the blocks
    def head(self, call: Call) -> Any:
        arguments = call.arguments
        hidden_in = arguments[self.spec.hidden_arg]
        self.head_in, self.encoder_in = hidden_in, arguments.get("encoder_hidden_states")
        device = hidden_in.device
        for part in self.parts.values():
            part.before_head(call)
        # these skip every block, the head too
        skipping = {r for p in self.parts.values() if p.skips_head for g in p.groups if not g.computes for r in g.rows}
        rows = [r for r in range(self.num_rows) if r not in skipping]
        if skipping:
            self.active, self.active_rows = device_index(rows, device), rows
            if not rows:
                return self._assemble(None)
            out = call.on_rows(self.num_rows, rows, self.active)
        else:
            out = call.run()
        self.head_out, self.head_pos = out, {row: i for i, row in enumerate(rows)}
        for part in self.parts.values():
            skipping |= part.after_head(arguments, hidden_in, rows)
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
        """What each method keeps of the last block's output, on the rows that ran it."""
        position = {row: i for i, row in enumerate(rows)}
        hidden = self.hidden(out)
        for part in self.parts.values():
            part.keep(hidden, position)

    def _assemble(self, computed: Any) -> Any:
        """The batch after the tail: skipping rows as their methods fill them, the rest what the blocks
        computed. Of the text stream only computed rows are kept: every family served discards it after the
        last block."""
        h = self.spec.hidden_index
        hidden = self.head_in.clone()
        for part in self.parts.values():
            part.fill(hidden)
        if computed is not None:
            hidden[self.active] = self.hidden(computed)
        if h is None:
            return hidden
        result = [None, None]
        result[h] = hidden
        encoder = None if computed is None else computed[1 - h]
        if computed is None or encoder is not None:
            result[1 - h] = self.encoder_in if computed is None else _put(self.encoder_in, encoder, self.active)
        return tuple(result)

    # the attention modules
    def attention(self, module: int, call: Call) -> Any:
        if not self.attending:
            return call.run()
        return self.attending[0].attention(module, call, self.active_rows)

    # what the methods' parts share
    def residual_view(self, g: Group, data: torch.Tensor, which: int) -> torch.Tensor:
        """The `which`th hidden-stream tensor in a group's state, as [rows, tokens, dim] (each method says
        what its tensors are)."""
        tokens = stream_tokens(self.spec, self.spec.layout.hidden_kind, self.image_tokens, g.text_tokens)
        size = tokens * self.spec.layout.inner_dim
        return data[:, which * size:(which + 1) * size].view(len(data), tokens, -1)

    def hidden(self, out: Any) -> torch.Tensor:
        """A block's hidden-stream output."""
        return out if self.spec.hidden_index is None else out[self.spec.hidden_index]

    # after the forward and the update succeeded
    def commit(self, write: Callable[[list[list[int]], torch.Tensor], None]) -> list[tuple[CacheState, int, int]]:
        """Writes the groups' new state; returns each request's (state, rows skipped, rows computed).
        A step counts as cached for a request when every group of it skipped."""
        by_request: dict[int, list[Group]] = {}
        for g in self.groups:
            by_request.setdefault(id(g.state), []).append(g)
            g.state.written = False  # the forward and the update succeeded: the new state is whole
            if g.new is not None and not g.in_place:
                write(g.blocks, pool_values(g.new, g.data.dtype))
        outcome = []
        for groups in by_request.values():
            state = groups[0].state
            skipped = sum(len(g.rows) for g in groups if not g.computes)
            outcome.append((state, skipped, sum(len(g.rows) for g in groups if g.computes)))
            self.parts[state.config.method].commit(state, groups)
        return outcome


class _CacheHook(ModelHook):
    """On one block or attention module (through diffusers' hook registry): the call as the forward's context
    decides it, given to the hook for the forward's span; as it is when no caching forward runs."""

    def __init__(self, decide: Callable) -> None:
        super().__init__()
        self.decide = decide
        self.signature: inspect.Signature | None = None
        self.context: ForwardContext | None = None  # the running forward's, while one runs

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)  # read once: Call binds every call's arguments to it
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        context, original = self.context, self.fn_ref.original_forward
        if context is None or context.cache is None:
            return original(*args, **kwargs)
        return self.decide(context.cache, Call(original, self.signature, args, kwargs, context.rows))


class CacheHooks:
    """Wraps the spec's blocks and attention modules once, their hooks added to `hooks`: each forward's context
    is given to them for its span."""

    def __init__(self, spec: CacheSpec, hooks: ForwardHooks) -> None:
        self.spec, self.hooks = spec, hooks
        last = len(spec.blocks) - 1
        for i, block in enumerate(spec.blocks):
            self._wrap(block, lambda f, call, i=i: f.head(call) if i == 0 else f.block(call, i == last))
        for j, module in enumerate(spec.attention):
            self._wrap(module, lambda f, call, j=j: f.attention(j, call))

    def _wrap(self, module: torch.nn.Module, decide: Callable) -> None:
        hook = _CacheHook(decide)
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        self.hooks.add(DENOISER, hook)


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
            groups.append(Group(state=s.cache, rows=rows, blocks=row_blocks, step=s.step,
                                num_steps=s.plan.num_steps, text_tokens=text_tokens, data=data,
                                index=device_index(rows, data.device), in_place=in_place))
    image_tokens = spec.layout.image_tokens(*layout.image_size)
    row_tokens = None
    if spec.mask_arg and text_lengths is not None:
        row_tokens = [stream_tokens(spec, spec.layout.hidden_kind, image_tokens, t) for t in text_lengths]
    return ForwardCache(spec, groups, layout.num_rows, image_tokens, row_tokens)
