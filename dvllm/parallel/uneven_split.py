"""The split and gather of diffusers' context-parallel plan, for sequences the group's size does not divide, on
gloo and NCCL alike (parallel/context_parallel.py puts these hooks where diffusers' own go).

diffusers' "anything" mode (`ulysses_anything`, `ring_anything`) cuts a sequence into shards that differ by a
token (`tensor_split`: the first ranks one longer) and its attention exchanges them unevenly, but its gather of
the output is a `dist.all_gather` into tensors of different sizes, which gloo refuses ("ProcessGroupGloo::
allgather: invalid tensor size"). Here the gather pads every shard to the longest and cuts the padding off after
an all-gather of equal sizes, which both backends take; the padding exists only inside that exchange of a
finished output, so nothing computed sees it.

A sequence shorter than the group (a 16x16 Flux image is one token) would leave a rank an empty shard, which
some transformers' code cannot take (Qwen-Image's rotary embedding reshapes it): the split raises TooFewTokens
instead, and the caller runs that forward whole, unsplit (parallel/group.py: on the leader alone).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE,
    _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
    ContextParallelGatherHook,
    ContextParallelSplitHook,
    _get_submodule_by_name,
)
from diffusers.models._modeling_parallel import ContextParallelConfig, ContextParallelInput, ContextParallelOutput


class TooFewTokens(Exception):
    """A forward's sequence (image, video or text tokens) is shorter than the group splitting it. Every process
    raises it at the same split (their inputs are the same), so none is left waiting in an exchange; the caller
    runs the forward whole instead (parallel/group.py)."""

    def __init__(self, tokens: int, size: int) -> None:
        super().__init__(f"a sequence of {tokens} token{'s' * (tokens != 1)} cannot be split across {size} "
                         "processes")
        self.tokens, self.size = tokens, size


# torch 2.13 renamed all_gather_tensor (deprecated there); older torch has only that name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def shard(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of `x` along `dim`, as diffusers' anything split cuts it."""
    return x.tensor_split(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x` joined along `dim` in rank order; the shards may differ in length there."""
    length = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    sizes = _all_gather(length, 0, group).tolist()  # (a host sync, as diffusers' gather makes)
    longest = max(sizes)
    x = x.movedim(dim, 0)  # the gather joins along the first dim
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
    out = funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))
    return torch.cat([out[r * longest:r * longest + n].movedim(0, dim) for r, n in enumerate(sizes)], dim=dim)


class UnevenSplitHook(ContextParallelSplitHook):
    """diffusers' split at a plan's entry, each rank's shard cut by `shard`; paused, it passes the call through
    (context_parallel_paused)."""

    paused = False

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return (args, kwargs) if self.paused else super().pre_forward(module, *args, **kwargs)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output if self.paused else super().post_forward(module, output)

    def _prepare_cp_input(self, x: torch.Tensor, cp_input: ContextParallelInput) -> torch.Tensor:
        if cp_input.expected_dims is not None and x.dim() != cp_input.expected_dims:
            return super()._prepare_cp_input(x, cp_input)  # (diffusers warns and leaves it whole)
        mesh, length = self.parallel_config._flattened_mesh, x.shape[cp_input.split_dim]
        if length < mesh.size():  # a rank's shard would be empty (every rank raises it here alike)
            raise TooFewTokens(length, mesh.size())
        return shard(x, cp_input.split_dim, mesh.get_group())


class UnevenGatherHook(ContextParallelGatherHook):
    """diffusers' gather at a plan's exit, by `gather`; paused, it passes the output through."""

    paused = False

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if self.paused:
            return output
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        if len(outputs) != len(self.metadata):
            raise ValueError(f"expected {len(self.metadata)} outputs to gather, got {len(outputs)}")
        group = self.parallel_config._flattened_mesh.get_group()
        outputs = [o if plan is None else gather(o, plan.gather_dim, group) for o, plan in zip(outputs, self.metadata)]
        return outputs[0] if single else tuple(outputs)


def apply_plan(transformer: torch.nn.Module, config: ContextParallelConfig) -> None:
    """The transformer's plan put on as diffusers' `apply_context_parallel` puts it, with these hooks: under
    diffusers' names, so that its `remove_context_parallel` takes them off."""
    for module_id, entry in type(transformer)._cp_plan.items():
        if isinstance(entry, dict):
            hook, name = UnevenSplitHook, _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format(module_id)
        else:
            entry = [entry] if isinstance(entry, ContextParallelOutput) else entry
            hook, name = UnevenGatherHook, _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
        modules = _get_submodule_by_name(transformer, module_id)
        for module in modules if isinstance(modules, list) else [modules]:
            # a hook each (diffusers' too: a split hook caches its module's signature)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook(entry, config), name)


def split_hooks(transformer: torch.nn.Module) -> list[UnevenSplitHook | UnevenGatherHook]:
    """The plan's hooks that apply_plan put on the transformer's modules."""
    return [hook for module in transformer.modules() if hasattr(module, "_diffusers_hook")
            for hook in module._diffusers_hook.hooks.values() if isinstance(hook, (UnevenSplitHook, UnevenGatherHook))]
