"""BlockManager bookkeeping: free list, cached entries, ref counts."""
import pytest

from dvllm.core.block_manager import BlockManager


def test_allocate_and_free_private_blocks():
    bm = BlockManager(8)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8)) and not bm.can_allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    bm.free(a)
    assert bm.can_allocate(3) and not bm.can_allocate(4) and bm.num_used_blocks == 5


def test_entries_are_shared_then_cached_then_evicted_lru():
    bm = BlockManager(6)
    first = bm.insert("x", 2)
    assert bm.lookup("x") is first and first.refs == 2
    bm.release(first)
    bm.release(first)
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 0
    second = bm.insert("y", 2)
    bm.release(second)
    assert bm.lookup("x") is first  # a hit on an idle entry revives it
    bm.release(first)               # x is now the most recently used
    assert bm.can_allocate(6)
    bm.allocate(3)                  # 2 free + evicts y (least recently used), not x
    assert "y" not in bm.index and "x" in bm.index
    assert (bm.cache_queries, bm.cache_hits) == (2, 2)


def test_invalidated_entries_are_never_hit_and_freed_with_their_last_user():
    bm = BlockManager(4)
    entry = bm.insert("k", 2)
    bm.invalidate(entry)
    assert bm.lookup("k") is None
    assert bm.num_used_blocks == 2
    bm.release(entry)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 0 and bm.can_allocate(4)
    idle = bm.insert("idle", 1)
    bm.release(idle)
    bm.invalidate(idle)  # invalidating an idle cached entry frees it at once
    assert bm.num_cached_blocks == 0 and len(bm.free_blocks) == 4


def test_cache_disabled_frees_on_last_release():
    bm = BlockManager(4, enable_cache=False)
    entry = bm.insert("k", 2)
    assert bm.lookup("k") is None
    bm.release(entry)
    assert bm.num_cached_blocks == 0 and len(bm.free_blocks) == 4
