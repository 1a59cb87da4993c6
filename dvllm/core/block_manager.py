"""Block bookkeeping for the state pool: free list, cached prompt conditions, ref counts. No tensors.

A request owns its latent and history blocks alone. Prompt conditions live in
entries keyed by what produced them (prompt text, positive or negative): requests
with the same key share one entry's blocks by ref count, and an entry whose last
user left stays cached (least recently used first out) until its blocks are needed.
Only the scheduler calls this.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field


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
    free_blocks: deque[int] = field(init=False)
    index: dict[Hashable, CachedEntry] = field(init=False, default_factory=dict)
    evictable: OrderedDict[Hashable, CachedEntry] = field(init=False, default_factory=OrderedDict)
    num_cached_blocks: int = field(init=False, default=0)  # held only by the cache: reclaimable
    cache_queries: int = field(init=False, default=0)
    cache_hits: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.free_blocks = deque(range(self.num_blocks))

    # -- private blocks ------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests."""
        return self.num_blocks - len(self.free_blocks) - self.num_cached_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: the free ones and those only the cache holds."""
        return len(self.free_blocks) + self.num_cached_blocks

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_available

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise RuntimeError(f"cannot allocate {num} blocks: {len(self.free_blocks)} free")  # scheduler bug
        while len(self.free_blocks) < num:  # reclaim the least recently used cached conditions
            key, entry = self.evictable.popitem(last=False)
            del self.index[key]
            self.num_cached_blocks -= len(entry.blocks)
            self.free_blocks.extend(entry.blocks)
        return [self.free_blocks.popleft() for _ in range(num)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

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
