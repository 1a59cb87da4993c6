"""Sequence parallelism for one denoiser forward across a group of processes, through diffusers' own context
parallelism: each process holds the whole transformer, the model's `_cp_plan` splits its inputs' tokens across
the group at the forward's entry and gathers the output at its exit, and attention exchanges what it needs
(Ulysses: an all-to-all that trades a slice of tokens for a slice of heads; Ring: key/value chunks passed
around). diffusers declares a plan per transformer class (Flux, Qwen-Image, Wan among dvllm's families); one
without a plan cannot be split, and is refused before the group starts.

The group is a torch.distributed process group (NCCL on GPUs, gloo on the CPU) that the caller initialized.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def has_plan(transformer: torch.nn.Module) -> bool:
    return bool(getattr(type(transformer), "_cp_plan", None))


def check_context_parallel(transformer: torch.nn.Module, ulysses_degree: int, ring_degree: int,
                           device: torch.device) -> None:
    """ValueError for a degree that cannot work with this transformer on this device."""
    for name, degree in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {degree!r}")
    if ulysses_degree * ring_degree == 1:
        return
    if not has_plan(transformer):
        raise ValueError(f"sequence_parallel_size: diffusers has no context-parallel plan (_cp_plan) for "
                         f"{type(transformer).__name__}: its forward's tokens cannot be split across a group "
                         "(cfg_parallel_size splits rows, for any family)")
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads is not None and heads % ulysses_degree:
        raise ValueError(f"ulysses_degree {ulysses_degree} must divide the model's {heads} attention heads (Ulysses "
                         "gives each process a slice of the heads)")
    if ring_degree > 1 and device.type == "cpu":
        raise ValueError("ring_degree > 1 needs an attention kernel that returns its log-sum-exp (flash, sage on a "
                         "GPU); the CPU's native attention does not: use ulysses_degree")


def enable_context_parallel(transformer: torch.nn.Module, ulysses_degree: int, ring_degree: int,
                            device: torch.device, row_groups: int = 1) -> None:
    """Splits the transformer's forwards across the current process group (every member calls it, and then
    runs the same forwards on the same inputs; each gets the whole output). With `row_groups` > 1 the group is
    a mesh [row_groups, ring, ulysses]: consecutive ranks split tokens among themselves, and each such run of
    ranks (a row group) runs its own slice of the rows (CFG-parallel and sequence parallel at once)."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel

    from dvllm.parallel.uneven_split import apply_plan

    check_context_parallel(transformer, ulysses_degree, ring_degree, device)
    if not torch.distributed.is_initialized():
        raise RuntimeError("context parallelism needs the group's torch.distributed process group initialized")
    world = torch.distributed.get_world_size()
    if ulysses_degree * ring_degree * row_groups != world:
        raise ValueError(f"ulysses_degree x ring_degree x row_groups ({ulysses_degree} x {ring_degree} x "
                         f"{row_groups}) must be the group's size, {world}")
    mesh = _mesh((row_groups, ring_degree, ulysses_degree)) if row_groups > 1 else None
    # One of the two alone splits a sequence of any length (a text of any tokens, an image of any patches)
    config = ContextParallelConfig(ulysses_degree=ulysses_degree, ring_degree=ring_degree, mesh=mesh,
                                   ulysses_anything=ring_degree == 1, ring_anything=ulysses_degree == 1)
    with _a_device_count():
        transformer.enable_parallelism(config=config)
    # diffusers' gather of unequal shards fails on gloo: its split and gather swapped for ours (uneven_split.py)
    remove_context_parallel(transformer, type(transformer)._cp_plan)
    apply_plan(transformer, config)


def rejoin_context_parallel(transformer: torch.nn.Module) -> None:
    """Points the transformer's split at the current process group: after the group was formed anew (a member
    lost), every member calls it in the same order, as it called enable_context_parallel."""
    config = transformer._parallel_config
    cp, old = config.context_parallel_config, config.context_parallel_config._mesh
    mesh = _mesh(tuple(old.mesh.shape), old.mesh_dim_names)  # the same shape (with row groups or not), anew
    if cp.mesh is not None:  # (a mesh of row groups was given, not made by diffusers: it is read from there too)
        cp.mesh = mesh
    config.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), config._device, mesh=mesh)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("rows", "ring", "ulysses")
          ) -> torch.distributed.device_mesh.DeviceMesh:
    """A device mesh over the group's ranks in order ([row groups, ring, ulysses]: a row group's ranks are
    consecutive)."""
    return torch.distributed.device_mesh.init_device_mesh(torch._C._get_accelerator().type, mesh_shape=shape,
                                                          mesh_dim_names=names)


@contextmanager
def context_parallel_paused(transformer: torch.nn.Module) -> Iterator[None]:
    """The transformer's split turned off for the calls inside (each process runs its own rows whole), and on
    again after: the plan's hooks pass their calls through, the attention processors told of no split meanwhile.
    The hooks stay where they are: removing and putting back hooks under others (the step cache's sit on the same
    blocks of Wan and Qwen-Image) would leave those calling the removed ones."""
    from dvllm.parallel.uneven_split import split_hooks

    config = transformer._parallel_config
    processors = [m.processor for m in transformer.modules()
                  if getattr(getattr(m, "processor", None), "_parallel_config", None) is config]
    hooks = split_hooks(transformer)
    for hook in hooks:
        hook.paused = True
    for processor in processors:
        processor._parallel_config = None
    try:
        yield
    finally:
        for hook in hooks:
            hook.paused = False
        for processor in processors:
            processor._parallel_config = config


def rows_split_pays(rows: int, size: int) -> bool:
    """The elastic policy's choice for a forward of `rows` on a group of `size`: rows (each process its rows
    whole, no exchange inside the forward) when every process gets as many rows, or at least two; tokens
    otherwise (fewer rows than processes, or a remainder that would leave some a row idle for most of the
    forward)."""
    return rows >= size and (rows % size == 0 or rows >= 2 * size)


@contextmanager
def _a_device_count() -> Iterator[None]:
    """diffusers picks each rank's device as `rank % torch.accelerator.device_count()`, which is a division by
    zero on a machine with no accelerator: there, for that call only, the count reads 1 (the CPU)."""
    count = torch.accelerator.device_count
    if count() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count
