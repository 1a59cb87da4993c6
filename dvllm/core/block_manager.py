"""Block bookkeeping for the state pool: free list, cached prompt conditions, ref counts. No tensors.

A request owns its latent and history blocks alone. Prompt conditions live in
entries keyed by what produced them (prompt text, positive or negative): requests
with the same key share one entry's blocks by ref count, and an entry whose last
user left stays cached (least recently used first out) until its blocks are needed.
Only the scheduler calls this.

Private blocks are handed out lowest id first; a request's step-cache state takes one run of
consecutive ids (`allocate_run`), the highest that fits, so that the worker updates it in place
through one view of the pool. Lowest-first keeps the many small, short-lived allocations at the
bottom of the pool and the runs at its top.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class CachedEntry:
    key: Hashable
    blocks: list[int]
    refs: int = 1
    valid: bool = True  # False once dropped from the index: freed, never cached, when its last user leaves


@dataclass
class BlockManager:
    num_blocks: int
    enable_cache: bool = True
    free_mask: np.ndarray = field(init=False)   # [num_blocks] bool: which blocks are free
    _heap: list[int] = field(init=False)        # free ids to hand out, lowest first (may hold stale ids)
    _num_free: int = field(init=False)
    index: dict[Hashable, CachedEntry] = field(init=False, default_factory=dict)
    evictable: OrderedDict[Hashable, CachedEntry] = field(init=False, default_factory=OrderedDict)
    num_cached_blocks: int = field(init=False, default=0)  # held only by the cache: reclaimable
    cache_queries: int = field(init=False, default=0)
    cache_hits: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.free_mask = np.ones(self.num_blocks, dtype=bool)
        self._heap = list(range(self.num_blocks))  # sorted: already a heap
        self._num_free = self.num_blocks

    # -- private blocks ------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests."""
        return self.num_blocks - self._num_free - self.num_cached_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: the free ones and those only the cache holds."""
        return self._num_free + self.num_cached_blocks

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_available

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise RuntimeError(f"cannot allocate {num} blocks: {self._num_free} free")  # scheduler bug
        while self._num_free < num:  # reclaim the least recently used cached conditions
            self._evict_one()
        blocks = []
        while len(blocks) < num:
            block = heapq.heappop(self._heap)
            if self.free_mask[block]:  # (an id a run took, or a second copy of a freed one: skipped)
                self.free_mask[block] = False
                blocks.append(block)
        self._num_free -= num
        return blocks

    def can_allocate_run(self, num: int, others: int = 0) -> bool:
        """Whether `num` consecutive blocks, and `others` more anywhere, can be had (reclaiming cached
        conditions if need be)."""
        if num + others > self.num_available:
            return False
        if num == 0:
            return True
        mask = self.free_mask.copy()
        for entry in self.evictable.values():
            mask[entry.blocks] = True
        return _highest_run(mask, num) is not None

    def allocate_run(self, num: int) -> list[int]:
        """`num` consecutive blocks: the highest free run that holds them. Where none is free, cached
        conditions are reclaimed, least recently used first, until one is."""
        start = _highest_run(self.free_mask, num)
        while start is None:
            if not self.evictable:
                raise RuntimeError(f"no run of {num} free blocks")  # scheduler bug: can_allocate_run said so
            self._evict_one()
            start = _highest_run(self.free_mask, num)
        self.free_mask[start:start + num] = False
        self._num_free -= num
        return list(range(start, start + num))

    def free(self, blocks: list[int]) -> None:
        self.free_mask[blocks] = True
        self._num_free += len(blocks)
        if len(self._heap) + len(blocks) > 2 * self.num_blocks:  # ids runs took pile up: start afresh
            self._heap = np.flatnonzero(self.free_mask).tolist()
            return
        for block in blocks:
            heapq.heappush(self._heap, block)

    def _evict_one(self) -> None:
        key, entry = self.evictable.popitem(last=False)
        del self.index[key]
        self.num_cached_blocks -= len(entry.blocks)
        self.free(entry.blocks)

    # -- shared, cached conditions ----------------------------------------------
    def lookup(self, key: Hashable) -> CachedEntry | None:
        """A live or cached entry for key, now referenced once more; None on a miss."""
        self.cache_queries += 1
        entry = self.index.get(key)
        if entry is None:
            return None
        self.cache_hits += 1
        if entry.refs == 0:
            del self.evictable[key]
            self.num_cached_blocks -= len(entry.blocks)
        entry.refs += 1
        return entry

    def blocks_to_claim(self, key: Hashable, num: int) -> int:
        """Available blocks a lookup-or-insert of key for num blocks would use up: num on a miss, the
        entry's blocks when only the cache holds it (they stop being reclaimable), none when it is live."""
        entry = self.index.get(key)
        if entry is None:
            return num
        return len(entry.blocks) if entry.refs == 0 else 0

    def blocks_freed_by(self, entry: CachedEntry | None, releases: int) -> int:
        """Blocks that become available when `releases` of the entry's references are released at once."""
        if entry is None or not entry.valid or releases < entry.refs:
            return 0
        return len(entry.blocks)

    def is_cached(self, key: Hashable) -> bool:
        """Whether a lookup of key would hit (without counting it as a query)."""
        return key in self.index

    def insert(self, key: Hashable, num: int) -> CachedEntry:
        """A new entry of num blocks for key (after a miss); the caller fills its blocks."""
        entry = CachedEntry(key, self.allocate(num))
        if self.enable_cache:
            self.index[key] = entry
        else:
            entry.valid = False
        return entry

    def release(self, entry: CachedEntry) -> None:
        entry.refs -= 1
        if entry.refs > 0:
            return
        if entry.valid:
            self.evictable[entry.key] = entry
            self.num_cached_blocks += len(entry.blocks)
        else:
            self.free(entry.blocks)

    def invalidate(self, entry: CachedEntry) -> None:
        """Its contents are not to be trusted (the write failed): no later lookup may hit it."""
        if entry.valid and self.index.get(entry.key) is entry:
            del self.index[entry.key]
        if entry.refs == 0 and self.evictable.get(entry.key) is entry:
            del self.evictable[entry.key]
            self.num_cached_blocks -= len(entry.blocks)
            self.free(entry.blocks)
        entry.valid = False


def _highest_run(free: np.ndarray, num: int) -> int | None:
    """The start of the highest `num` free blocks in a row (ending where their run ends), or None."""
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs [start, end)
    fitting = np.flatnonzero(ends - starts >= num)
    return None if not fitting.size else int(ends[fitting[-1]] - num)
