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


def test_a_sliding_window_gives_back_the_blocks_behind_it():
    """Every layer attends to the last 6 tokens, blocks of 4. A step computing positions from p on reads
    keys from p - 5 on: the blocks ending before that go back to the pool (cached ones findable until
    reused), the null block taking their place in the table; worked by hand."""
    bm = BlockManager(num_blocks=9, block_size=4, window=6)  # the null block + 8
    s = seq("s", list(range(100, 110)))  # positions 0-9: blocks 1 (0-3), 2 (4-7), 3 (8-9)
    assert admit(bm, s) == ([], [1, 2, 3])  # the prefill's first query (position 0) reads from 0: nothing goes
    assert bm.num_free_blocks == 5

    def decode(token: int) -> list[int]:  # one decode step: the token at position num_tokens - 1
        s.append_token(token)
        new = bm.allocate_slots(s, 1)
        s.num_computed_tokens += 1
        bm.check_integrity()
        return new.block_ids

    assert decode(110) == [] and s.block_table == [0, 2, 3]  # position 10 reads 5-10: block 1 (0-3) goes
    assert bm.num_free_blocks == 6 and bm.num_window_released == 1
    assert bm.pool.blocks[1].hash is not None and free_order(bm)[-1] == 1  # cached, evicted last
    assert decode(111) == [] and s.block_table == [0, 2, 3]  # position 11 reads 6-11: block 2 (4-7) stays
    assert decode(112) == [4] and s.block_table == [0, 2, 3, 4]  # position 12 reads 7-12
    assert decode(113) == [] and s.block_table == [0, 0, 3, 4]  # position 13 reads 8-13: block 2 goes
    assert bm.num_free_blocks == 6 and bm.num_window_released == 2

    # a later prompt with the same first 8 tokens finds them in the prefix cache: their blocks come back from
    # the free queue, and the new sequence gives them up again as it moves past them
    t = seq("t", list(range(100, 108)) + [7, 7, 7])
    computed, n = bm.get_computed_blocks(t)
    assert (computed.block_ids, n) == ([1, 2], 8)
    assert bm.allocate_slots(t, 3, computed).block_ids == [5] and t.block_table == [1, 2, 5]  # 8-10 read from 3
    t.num_computed_tokens = 11
    for token in (7, 7):
        t.append_token(token)
        bm.allocate_slots(t, 1)
        t.num_computed_tokens += 1
    assert t.block_table == [0, 2, 5, 6] and bm.pool.blocks[1].ref_cnt == 0  # position 12 reads from 7
    bm.check_integrity()

    bm.free(s)  # the null entries are not released again
    bm.free(t)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_a_window_releases_blocks_within_a_chunked_prefill_and_a_truncation_keeps_them():
    bm = BlockManager(num_blocks=9, block_size=4, window=6, enable_caching=False)
    s = seq("s", list(range(24)))
    assert bm.allocate_slots(s, 12).block_ids == [1, 2, 3]  # chunk 0-11
    s.num_computed_tokens = 12
    # chunk 12-23: its first query (12) reads from 7, so block 1 (0-3) goes and block 2 (4-7) stays
    assert bm.allocate_slots(s, 12).block_ids == [4, 5, 6] and s.block_table == [0, 2, 3, 4, 5, 6]
    s.num_computed_tokens = 24
    assert free_order(bm)[0] == 1  # uncached: the front of the queue
    s.token_ids += [1, 2, 3]  # a speculative step: a token and two drafts at 24-26
    # 24 reads from 19: blocks 2-4 (4-15) go, after the new block is taken (block 1 again, the queue's front)
    assert bm.allocate_slots(s, 3).block_ids == [1] and s.block_table == [0, 0, 0, 0, 5, 6, 1]
    assert free_order(bm)[:3] == [2, 3, 4]
    s.num_computed_tokens = 25  # both drafts rejected: the sequence's computed tokens rolled back to 25
    bm.truncate(s)
    assert s.block_table == [0, 0, 0, 0, 5, 6, 1]
    s.num_computed_tokens = 24  # and to 24: the block past position 23 goes
    bm.truncate(s)
    assert s.block_table == [0, 0, 0, 0, 5, 6]
    bm.check_integrity()
    bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_under_a_window_a_prefix_hit_needs_only_the_blocks_its_next_query_reads():
    """A conversation's earlier turn was cached; its head block was evicted since (the pool reused it). Without a
    window that voids the whole hit; under one, the next query reads only the last window: the hit stands, the
    null block in place of the evicted head. Worked by hand: blocks of 4, window 6."""
    bm = BlockManager(num_blocks=9, block_size=4, window=6)
    turn = list(range(100, 116))  # 16 tokens: blocks 1-4
    s = seq("s", turn)
    assert admit(bm, s) == ([], [1, 2, 3, 4])
    bm.free(s)
    assert free_order(bm)[-4:] == [4, 3, 2, 1]  # cached, tail first
    head = bm.pool.blocks[1]
    bm.pool.free_queue.remove(head)  # the pool reused block 1 for someone else, who gave it back: its hash is gone
    bm.pool._uncache(head)
    bm.pool.free_queue.push_front(head)
    bm.check_integrity()

    t = seq("t", turn + [7, 7])  # the next turn: 18 tokens
    computed, n = bm.get_computed_blocks(t)
    # 4 blocks hit: the next query (position 16) reads 11-16, blocks 3-4 (of the cached 2-4): the null block stands
    # for the evicted block 1 and for block 2, which it does not read (taken, it would only be given back)
    assert (computed.block_ids, n) == ([0, 0, 3, 4], 16)
    assert bm.free_blocks_needed(t, 2, computed) == 3  # a new block, and the two cached free ones taken back
    new = bm.allocate_slots(t, 2, computed)
    t.num_computed_tokens = 18
    assert new.block_ids == [1] and t.block_table == [0, 0, 3, 4, 1]
    assert bm.pool.blocks[2].ref_cnt == 0 and bm.pool.blocks[2].hash is not None  # still cached, still free
    bm.check_integrity()
    bm.free(t)
    bm.check_integrity()

    plain = BlockManager(num_blocks=9, block_size=4)  # without a window the same evicted head voids the hit
    u = seq("u", turn)
    admit(plain, u)
    plain.free(u)
    plain.pool._uncache(plain.pool.blocks[1])
    assert plain.get_computed_blocks(seq("v", turn + [7, 7])) == (KVBlocks(), 0)
