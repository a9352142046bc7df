"""The physical KV blocks: reference counts, an O(1) free queue, and the prefix-cache index.

Invariants (`check_integrity` verifies all of them):

- Block 0 is the null block: never handed out, never freed; block tables are padded with it, and it
  stands in for the blocks a sequence gave back behind a sliding window.
- A block is in the free queue if and only if its ref_cnt is 0 (the null block aside).
- The free queue is in eviction order: the front is taken first. A freed block that holds a
  cached full block keeps its hash (a later request may revive it with `touch`) until it is
  taken from the front for new data; freed blocks without a hash go to the front, since
  nothing can ever hit them.
- `cached[h]` is a block whose hash is h; a block's hash is in `cached` at most once.
"""
from __future__ import annotations

from typing import Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: bytes | None = None  # set while the block holds a full, cached block of tokens
        self.prev: KVBlock | None = None  # free-queue links; None when not in the queue
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.hash is not None})"


class FreeBlockQueue:
    """A doubly linked list of blocks with O(1) push at either end, pop at the front and
    removal from the middle (when a cached free block is hit again)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self.head = KVBlock(-1)  # sentinels
        self.tail = KVBlock(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.push_back(b)

    def __len__(self) -> int:
        return self.size

    def _link(self, b: KVBlock, before: KVBlock) -> None:
        after = before.next
        b.prev, b.next = before, after
        before.next = after.prev = b
        self.size += 1

    def push_back(self, b: KVBlock) -> None:
        self._link(b, self.tail.prev)

    def push_front(self, b: KVBlock) -> None:
        self._link(b, self.head)

    def remove(self, b: KVBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def pop_front(self) -> KVBlock:
        b = self.head.next
        if b is self.tail:
            raise IndexError("no free block")
        self.remove(b)
        return b

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


NULL_BLOCK_ID = 0  # the null block's id in every pool (and in a pipeline's block tables)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # pinned
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.enable_caching = enable_caching
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold tokens (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def take(self, n: int) -> list[KVBlock]:
        """n blocks for new data, from the front of the free queue; a cached block taken here is
        evicted from the prefix cache."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks with only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b = self.free_queue.pop_front()
            if b.hash is not None:
                self._uncache(b)
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits); revive free ones."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order: blocks that reach zero join the
        free queue's back (cached ones, to be evicted last-freed-last) or front (uncached)."""
        for b in blocks:
            if b.ref_cnt <= 0 or b is self.null_block:
                raise ValueError(f"releasing {b}, which holds no reference")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hash is None:
                    self.free_queue.push_front(b)
                else:
                    self.free_queue.push_back(b)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that `block` holds the full block of tokens whose chained hash is block_hash."""
        if not self.enable_caching or block.hash is not None:
            return
        if block_hash in self.cached:  # the same tokens computed twice: keep the first copy
            return
        block.hash = block_hash
        self.cached[block_hash] = block

    def _uncache(self, b: KVBlock) -> None:
        if self.cached.get(b.hash) is b:
            del self.cached[b.hash]
        b.hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached free block; returns how many were forgotten."""
        n = 0
        for b in self.free_queue:
            if b.hash is not None:
                self._uncache(b)
                n += 1
        return n

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if an invariant is broken. `expected_refs` (block id -> number of
        block tables holding it), when given, must match every block's ref_cnt exactly."""
        queued = []
        prev = self.free_queue.head
        for b in self.free_queue:
            assert b.prev is prev, f"free queue back-link broken at {b}"
            queued.append(b.block_id)
            prev = b
        assert self.free_queue.tail.prev is prev, "free queue tail link broken"
        assert len(queued) == len(set(queued)) == self.free_queue.size, "free queue has duplicates or a bad size"
        assert self.null_block.ref_cnt == 1 and 0 not in queued, "the null block was handed out or freed"
        free_by_ref = {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        assert set(queued) == free_by_ref, (f"free queue and zero ref counts disagree: "
                                            f"{sorted(set(queued) ^ free_by_ref)[:10]}")
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        for h, b in self.cached.items():
            assert b.hash == h, f"cache index points at {b}, whose hash differs"
        hashed = [b for b in self.blocks if b.hash is not None]
        assert len(hashed) == len(self.cached), "a block has a hash that the cache index does not list"
        if expected_refs is not None:
            for b in self.blocks[1:]:
                want = expected_refs.get(b.block_id, 0)
                assert b.ref_cnt == want, f"block {b.block_id} has ref_cnt {b.ref_cnt}, block tables hold {want}"
