"""A request's blocks in the state pool: what admitting it takes, its tables, and giving them back.

Private blocks (latents, a sampler's history, input images' state, step caching's state) are the request's own;
its texts' conditions are prompt-cache entries, shared by every request with the same key and filled by the first
one admitted (the one whose step writes them). Its control images are entries of the same cache, keyed by their
digest: requests (or controls of one request) with the same prepared image hold one copy. The worker writes a
control image before anything of its step can fail, so an entry is never left unwritten.
"""
from __future__ import annotations

from typing import Any

from dvllm.core.block_manager import BlockManager, CachedEntry
from dvllm.core.request import Request
from dvllm.core.scheduler_output import BlockTables


def blocks_needed(blocks: BlockManager, request: Request) -> int:
    """Blocks admission takes out of the free and reclaimable ones: a prompt-cache miss needs new blocks, and a
    hit on an idle cached entry makes that entry's blocks unreclaimable."""
    texts = sum(blocks.blocks_to_claim(key, request.cond_blocks) for key in request.cond_keys if key is not None)
    images = sum(blocks.blocks_to_claim(key, request.control_blocks) for key in dict.fromkeys(request.control_keys))
    return request.private_blocks + texts + images


def can_allocate(blocks: BlockManager, request: Request, extra_blocks: int = 0) -> bool:
    """Whether its blocks can be had: its step-cache state in one run (the worker updates it in place)."""
    needed = blocks_needed(blocks, request) + extra_blocks
    run = request.rows * request.cache_blocks
    return blocks.can_allocate_run(run, needed - run) if run else blocks.can_allocate(needed)


def allocate_blocks(blocks: BlockManager, request: Request) -> tuple[BlockTables, list[Any]]:
    """Its tables (also kept on the request), and the shared entries (texts, control images) it is the first to
    fill."""
    n, nb, per_row = request.params.n, request.latent_blocks, request.cache_blocks
    cache = None
    if per_row:  # first, while the run admission found is still free: row r is the run's r-th part
        run = blocks.allocate_run(request.rows * per_row)
        cache = [run[r * per_row:(r + 1) * per_row] for r in range(request.rows)]
    latents = [blocks.allocate(nb) for _ in range(n)]
    # image i's history slots are runs i * slots ... (i + 1) * slots - 1
    history = [blocks.allocate(nb) for _ in range(n * request.history_slots)] if request.history_slots else None
    inputs = [blocks.allocate(request.input_blocks) for _ in range(n)] if request.input_blocks else None
    filled: list[CachedEntry] = []
    entries, writes = _shared(blocks, request.cond_keys, request.cond_blocks, filled)
    request.cond_entry, request.uncond_entry = entries
    controls, control_writes = _shared(blocks, request.control_keys, request.control_blocks, filled)
    request.control_entries = tuple(controls)
    request.blocks = BlockTables(
        latents=latents, history=history, cache=cache, inputs=inputs, cond=entries[0].blocks,
        uncond=entries[1].blocks if entries[1] else None, write_cond=writes[0], write_uncond=writes[1],
        controls=tuple(tuple(e.blocks) for e in controls), write_controls=tuple(control_writes),
    )
    return request.blocks, filled


def _shared(blocks: BlockManager, keys: tuple, num: int, filled: list[CachedEntry]
            ) -> tuple[list[CachedEntry | None], list[bool]]:
    """Each key's entry (None for None) and whether this request writes it: a miss inserts one of `num` blocks,
    which joins `filled`."""
    entries, writes = [], []
    for key in keys:
        entry = None if key is None else blocks.lookup(key)
        writes.append(key is not None and entry is None)
        if key is not None and entry is None:
            entry = blocks.insert(key, num)
            filled.append(entry)
        entries.append(entry)
    return entries, writes


def free_blocks(blocks: BlockManager, request: Request) -> None:
    """Its private blocks freed and its prompt-cache entries let go (they stay cached for others)."""
    tables = request.blocks
    for run in tables.latents + (tables.history or []) + (tables.cache or []) + (tables.inputs or []):
        blocks.free(run)
    for entry in request.shared_entries:
        blocks.release(entry)
    request.blocks = request.cond_entry = request.uncond_entry = None
    request.control_entries = ()
