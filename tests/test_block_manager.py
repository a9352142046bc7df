"""BlockPool / BlockManager: exact block ids, reference counts, prefix hits and eviction order."""
from __future__ import annotations

import pytest

from flotilla.runtime.block_manager import BlockManager, KVBlocks, hash_block
from flotilla.runtime.block_pool import BlockPool
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.sequence import Sequence

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def admit(bm: BlockManager, s: Sequence) -> tuple[list[int], list[int]]:
    """Admit a sequence with its whole prompt: (hit block ids, new block ids)."""
    computed, n = bm.get_computed_blocks(s)
    new = bm.allocate_slots(s, s.num_tokens - n, computed)
    assert new is not None
    s.num_computed_tokens = s.num_tokens
    return computed.block_ids, new.block_ids


def free_order(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.pool.free_queue]


def test_prefix_hits_refcounts_and_eviction_order():
    bm = BlockManager(num_blocks=11, block_size=BS)  # the null block + 10
    s0 = seq("0", COMMON + [3] * 7)
    assert admit(bm, s0) == ([], [1, 2, 3, 4])
    assert s0.block_table == [1, 2, 3, 4]
    parent = b"\0" * 16
    for block_id in (1, 2, 3):  # full blocks are cached under their chained hash
        parent = hash_block(parent, COMMON[(block_id - 1) * BS:block_id * BS])
        assert bm.pool.blocks[block_id].hash == parent and bm.pool.cached[parent].block_id == block_id
    assert bm.pool.blocks[4].hash is None  # the partial block is not

    s1 = seq("1", COMMON + [3] * 5)  # hit while the blocks are in use
    assert admit(bm, s1) == ([1, 2, 3], [5])
    assert [bm.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert bm.num_free_blocks == 5
    bm.check_integrity()

    bm.free(s0)
    bm.free(s1)
    # uncached blocks first (taken first), never-used ones, then cached ones, tail before head
    assert free_order(bm) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    bm.check_integrity()

    s2 = seq("2", COMMON + [3] * 6)  # hit on free cached blocks revives them
    assert admit(bm, s2) == ([1, 2, 3], [5])
    assert free_order(bm) == [4, 6, 7, 8, 9, 10]
    bm.free(s2)

    s3 = seq("3", [99] * (BS * 10))  # takes everything; the block ids show the eviction order
    assert admit(bm, s3) == ([], [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    assert bm.pool.num_evictions == 3 and bm.num_free_blocks == 0
    assert [bm.pool.get_cached_block(h) for h in bm.block_hashes(seq("x", COMMON + [1]), 3)] == [None] * 3
    bm.check_integrity()


def test_no_room_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq("a", list(range(40)))  # 3 blocks
    admit(bm, a)
    b = seq("b", list(range(100, 120)))
    before = (free_order(bm), [blk.ref_cnt for blk in bm.pool.blocks])
    assert bm.allocate_slots(b, 20) is None
    assert (free_order(bm), [blk.ref_cnt for blk in bm.pool.blocks]) == before and b.block_table == []
    bm.check_integrity()


def test_hit_needs_the_same_prefix_and_leaves_one_token():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = seq("a", list(range(32)) + [7])
    admit(bm, a)
    # same second block, different first block: the chained hash misses
    b = seq("b", [5] * 16 + list(range(16, 32)) + [7])
    assert bm.get_computed_blocks(b) == (KVBlocks(), 0)
    # exactly two full cached blocks: only one may be reused (the last token must be computed)
    c = seq("c", list(range(32)))
    computed, n = bm.get_computed_blocks(c)
    assert computed.block_ids == [1] and n == 16


def test_decode_growth_caches_blocks_as_they_fill():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq("s", list(range(15)))
    admit(bm, s)
    assert s.block_table == [1] and bm.pool.blocks[1].hash is None
    s.append_token(15)  # the 16th token fills block 1 when it is computed
    assert bm.allocate_slots(s, 1).block_ids == []
    assert bm.pool.blocks[1].hash == hash_block(b"\0" * 16, list(range(16)))
    s.num_computed_tokens += 1
    s.append_token(16)
    assert bm.allocate_slots(s, 1).block_ids == [2]
    bm.check_integrity()


def test_chunked_prefill_allocates_per_chunk():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq("s", list(range(50)))
    computed, _ = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, 20, computed).block_ids == [1, 2]
    s.num_computed_tokens = 20
    assert bm.allocate_slots(s, 20).block_ids == [3]
    s.num_computed_tokens = 40
    assert bm.allocate_slots(s, 10).block_ids == [4]
    assert [bm.pool.blocks[i].hash is not None for i in (1, 2, 3, 4)] == [True, True, True, False]


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq("s", list(range(40)))
    admit(bm, s)
    bm.check_integrity()
    bm.pool.blocks[2].ref_cnt += 1  # a leaked reference
    with pytest.raises(AssertionError, match="block 2 has ref_cnt 2"):
        bm.check_integrity()
    bm.pool.blocks[2].ref_cnt -= 1
    bm.pool.free_queue.push_back(bm.pool.blocks[3])  # a used block on the free list
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_pool_rejects_double_free_and_keeps_null_block():
    pool = BlockPool(4)
    [b] = pool.take(1)
    assert b.block_id == 1
    pool.release([b])
    with pytest.raises(ValueError, match="holds no reference"):
        pool.release([b])
    with pytest.raises(ValueError):
        pool.take(4)  # only 3 usable blocks
    assert [x.block_id for x in pool.take(3)] == [1, 2, 3]
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = seq("a", list(range(33))), seq("b", list(range(100, 133)))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert bm.pool.reset_prefix_cache() == 2
    assert bm.get_computed_blocks(seq("a2", list(range(33))))[1] == 0
    assert bm.get_computed_blocks(seq("b2", list(range(100, 133))))[1] == 32
    bm.check_integrity()
