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
    assert bm.num_cached_blocks == 0 and bm.num_free == 4


def test_cache_disabled_frees_on_last_release():
    bm = BlockManager(4, enable_cache=False)
    entry = bm.insert("k", 2)
    assert bm.lookup("k") is None
    bm.release(entry)
    assert bm.num_cached_blocks == 0 and bm.num_free == 4


def test_private_blocks_go_lowest_first_and_runs_take_the_highest_free_run():
    bm = BlockManager(num_blocks=16)
    low = bm.allocate(3)
    assert low == [0, 1, 2]
    run = bm.allocate_run(5)
    assert run == list(range(11, 16))  # the top of the pool, away from the small allocations
    bm.free([1])
    assert bm.allocate(2) == [1, 3]  # the lowest free ids, a freed one first
    assert bm.num_free == 16 - 3 - 5 - 1
    assert bm.can_allocate_run(7) and not bm.can_allocate_run(8)  # 4..10 is the longest free run
    assert bm.allocate_run(7) == list(range(4, 11))
    assert not bm.can_allocate_run(1)
    bm.free(run)
    assert bm.allocate_run(2) == [14, 15]
    assert bm.allocate(3) == [11, 12, 13]  # ids a run held, handed out again once freed (no stale ones)


def test_a_run_reclaims_idle_cached_conditions_until_one_is_free():
    bm = BlockManager(num_blocks=8)
    held = bm.allocate(2)  # [0, 1]
    entry = bm.insert("p", 2)  # [2, 3]
    bm.release(entry)  # idle: reclaimable
    other = bm.allocate(1)  # [4]
    assert (held, entry.blocks, other) == ([0, 1], [2, 3], [4])
    assert not bm.can_allocate_run(3, others=3)  # 3 in a row and 3 more: 6 > 5 available
    assert bm.can_allocate_run(3) and bm.allocate_run(3) == [5, 6, 7]  # free already: the cache keeps "p"
    assert bm.is_cached("p")
    assert bm.can_allocate_run(2) and not bm.can_allocate_run(3)
    assert bm.allocate_run(2) == [2, 3] and not bm.is_cached("p")  # reclaimed for the run
    assert bm.num_available == 0


def test_many_runs_freed_and_taken_again_keep_the_free_list_bounded():
    bm = BlockManager(num_blocks=64)
    for _ in range(500):
        run = bm.allocate_run(40)
        bm.free(run)
    assert len(bm._heap) <= 2 * 64
    assert sorted(bm.allocate(64)) == list(range(64))
