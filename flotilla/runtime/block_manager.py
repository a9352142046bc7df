"""Per-sequence block tables over a BlockPool, with prefix caching.

A full block of tokens is identified by a hash chained on its prefix: hash(parent hash, its 16
token ids), so two sequences share a cached block only if everything before it matches too.
Blocks are cached as soon as a step that fills them is scheduled (their keys and values are
written by that step's forward, before any later read).

A sliding window (`window` > 0: every layer of the model attends to the last `window` tokens only) lets
a sequence give back the blocks that fall wholly behind it: once a step computes positions from c on, no
read of that step or a later one reaches a position before c - window + 1, so the blocks that end before it
are released (a cached one stays findable in the prefix cache until the pool reuses it) and the null block
takes their place in the table. A step still running on the device when the next one is scheduled (the
overlapped decode) reads a window that starts one token earlier, but on the same stream as the next step's
writes, so a block released for the next step is rewritten only after that read.

The scheduler sees allocation results only as `KVBlocks`, an opaque value it can count and pass
back; it never reaches into the pool.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from .block_pool import BlockPool, KVBlock
from .sequence import Sequence

_ROOT_HASH = b"\0" * 16


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The chained hash of one full block (16-byte BLAKE2b; collisions are not a practical concern)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class KVBlocks:
    """An allocation result: some blocks, in block-table order."""

    blocks: tuple[KVBlock, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


_NO_BLOCKS = KVBlocks()


class _OnePool:
    """What a manager over one BlockPool (`self.pool`) answers from it."""

    pool: BlockPool
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_room(self, seq: Sequence, num_new_tokens: int, computed=KVBlocks(), keep: float = 0.0) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens, computed)` would leave at least `keep` (a fraction of
        the pool) of the blocks free."""
        return self.num_free_blocks - self.free_blocks_needed(seq, num_new_tokens, computed) >= int(keep * self.num_blocks)

    def has_room_for_decodes(self, seqs: list[Sequence]) -> bool:
        """Whether one more token for each of `seqs` fits the free blocks."""
        return sum(self.free_blocks_needed(seq, 1) for seq in seqs) <= self.num_free_blocks

    def reset_prefix_cache(self) -> int:
        """Forget every cached free block; returns how many were forgotten."""
        return self.pool.reset_prefix_cache()


class BlockManager(_OnePool):
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True, window: int = 0,
                 pool: BlockPool | None = None, group: int = 0):
        """`pool`, `group`: one group of layers of a HybridBlockManager, whose groups share one pool: the
        sequence's table of group g > 0 is `seq.group_tables[g]`, and its blocks' prefix-cache keys are the
        chained hashes marked with g (the same tokens' keys and values in other layers are other blocks)."""
        self.block_size = block_size
        self.window = window  # every layer's sliding window, in tokens (0: some layer reads the whole context)
        self.group = group
        self._salt = bytes([group]) if group else b""
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashed: dict[str, int] = {}  # per table: its leading blocks known to hold a hash
        self._dropped: dict[str, int] = {}  # per table: its leading blocks given back (behind the window)
        self.num_window_released = 0  # blocks given back behind a window, since the start

    # ------------------------------------------------------------------ queries
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the sequence's first num_blocks full blocks (computed once)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else _ROOT_HASH, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]

    def get_computed_blocks(self, seq: Sequence) -> tuple[KVBlocks, int]:
        """The longest cached prefix of a sequence that holds no blocks yet, and its length in
        tokens. At least one token is always left to compute (its logits are needed)."""
        if not self.pool.enable_caching or seq.needs_prompt_logprobs:  # a cached block gives no logits
            return KVBlocks(), 0
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        if self.window:
            return self._window_hit(hashes)
        hits = []
        for h in hashes:
            block = self.pool.get_cached_block(h + self._salt)
            if block is None:
                break
            hits.append(block)
        return KVBlocks(tuple(hits)), len(hits) * self.block_size

    def _window_hit(self, hashes: list[bytes]) -> tuple[KVBlocks, int]:
        """Under a sliding window a hit of n blocks needs only the blocks that the first query after it (position
        n * block_size) reads: those from (n * block_size - window + 1) on; the ones before (evicted or not) stand
        as the null block. The longest such hit, as vLLM's sliding-window manager finds it."""
        bs, blocks, run = self.block_size, [], 0
        best, best_run = 0, 0  # the longest hit, and the cached blocks that end it
        for n, h in enumerate(hashes, 1):
            block = self.pool.get_cached_block(h + self._salt)
            blocks.append(block)
            run = run + 1 if block is not None else 0
            if run and run >= n - max(0, n * bs - self.window + 1) // bs:
                best, best_run = n, run
        # from the first block the next query reads (cached blocks before it would be taken only to be given back)
        start = max(best - best_run, max(0, best * bs - self.window + 1) // bs)
        return KVBlocks((self.pool.null_block,) * start + tuple(blocks[start:best])), best * bs

    def free_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed: KVBlocks = KVBlocks()) -> int:
        """Free blocks that `allocate_slots(seq, num_new_tokens, computed)` would use up
        (new blocks, plus prefix hits that are now free and would leave the free queue)."""
        table = self._tables.get(seq.request_id, [])
        total = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = max(0, self.blocks_for(total) - len(table) - len(computed))
        return need + sum(1 for b in computed.blocks if b.ref_cnt == 0)

    # ------------------------------------------------------------------ changes
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: KVBlocks = KVBlocks(),
                       touched: bool = False) -> KVBlocks | None:
        """Make room for `num_new_tokens` more tokens after the sequence's computed ones (plus
        the `computed` prefix hit, for a sequence being admitted). Returns the newly taken blocks,
        or None, changing nothing, when the pool cannot provide them. A decode that stays in its
        last block costs O(1): the table is replaced only when it grows (`seq.block_table` is
        never changed in place, so a step may hold on to it). `touched`: the caller has taken its
        reference on the hit's blocks already (HybridBlockManager: every group's, before any group
        takes new blocks, which could otherwise evict another group's hit from the free queue)."""
        table = self._tables.get(seq.request_id)
        total = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        if table is not None and not computed and total <= len(table) * self.block_size:
            new = _NO_BLOCKS  # the slots are in the table already
        else:
            table = table or []
            num_new = max(0, self.blocks_for(total) - len(table) - len(computed))
            revived = 0 if touched else sum(1 for b in computed.blocks if b.ref_cnt == 0)
            if num_new + revived > self.pool.num_free_blocks:
                return None
            gone = sum(b is self.pool.null_block for b in computed.blocks)  # a window hit's head (_window_hit)
            if not touched:
                self.pool.touch(computed.blocks[gone:])
            new = KVBlocks(tuple(self.pool.take(num_new)))
            table = table + list(computed.blocks) + list(new.blocks)
            if gone:
                self._dropped[seq.request_id] = gone
            self._tables[seq.request_id] = table
            self._set_ids(seq, [b.block_id for b in table])
        if self.pool.enable_caching:  # only blocks of real tokens: never a speculative step's drafts
            self._cache_full_blocks(seq, table, min(total, seq.num_tokens) // self.block_size)
        if self.window:
            self._release_behind_window(seq, table, total - num_new_tokens)
        return new

    def _release_behind_window(self, seq: Sequence, table: list[KVBlock], first: int) -> None:
        """Give back the table's blocks that end before position first - window + 1, the earliest key that a
        step computing positions from `first` on reads (module docstring)."""
        behind = (first - self.window + 1) // self.block_size  # blocks wholly before that position
        done = self._dropped.get(seq.request_id, 0)
        if behind <= done:
            return
        self.pool.release(reversed(table[done:behind]))  # the head last: the likelier to be shared
        null = self.pool.null_block
        table[done:behind] = [null] * (behind - done)  # `table` is this manager's own list
        self._dropped[seq.request_id] = behind
        self.num_window_released += behind - done
        self._set_ids(seq, [b.block_id for b in table])  # a new list: a step may hold on to the old one

    def _cache_full_blocks(self, seq: Sequence, table: list[KVBlock], full: int) -> None:
        """Offer the table's first `full` blocks to the prefix cache, from the first one that
        holds no hash yet (a block in a table never loses its hash, so the ones before it are done)."""
        i = max(self._hashed.get(seq.request_id, 0), self._dropped.get(seq.request_id, 0))
        if i >= full:
            return
        hashes = self.block_hashes(seq, full)
        while i < full and table[i].hash is not None:
            i += 1
        self._hashed[seq.request_id] = i
        for j in range(i, full):
            self.pool.cache(table[j], hashes[j] + self._salt)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its tail is evicted before its head, which other
        requests are likelier to share."""
        table = self._tables.pop(seq.request_id, [])
        self._hashed.pop(seq.request_id, None)
        dropped = self._dropped.pop(seq.request_id, 0)  # the null block stands in for those
        self.pool.release(reversed(table[dropped:]))
        self._set_ids(seq, [])

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens (the slots of rejected draft
        tokens, after `num_computed_tokens` was rolled back); the table shrinks to
        blocks_for(num_computed_tokens). Those blocks hold no cached hash (hashes cover real tokens
        only), so they go to the front of the free queue."""
        table = self._tables.get(seq.request_id)
        keep = self.blocks_for(seq.num_computed_tokens)
        if table is None or len(table) <= keep:
            return
        self.pool.release(reversed(table[keep:]))
        self._tables[seq.request_id] = table[:keep]
        self._hashed[seq.request_id] = min(self._hashed.get(seq.request_id, 0), keep)
        self._set_ids(seq, [b.block_id for b in table[:keep]])

    def holds(self, seq: Sequence) -> bool:
        return seq.request_id in self._tables

    def _set_ids(self, seq: Sequence, ids: list[int]) -> None:
        if self.group:
            seq.group_tables[self.group] = ids
        else:
            seq.block_table = ids

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every block's ref_cnt equals the number of block tables
        that hold it, and each table's ids match its sequence's view."""
        self.pool.check_integrity(self._refs())

    def _refs(self, refs: dict[int, int] | None = None) -> dict[int, int]:
        """Block id -> the tables that hold it, added to `refs`."""
        refs = {} if refs is None else refs
        for rid, table in self._tables.items():
            dropped = self._dropped.get(rid, 0)
            assert all(b is self.pool.null_block for b in table[:dropped]), f"{rid}: a released block is still held"
            assert all(b is not self.pool.null_block for b in table[dropped:]), f"{rid}: the null block past the released"
            for b in table[dropped:]:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs


@dataclass(frozen=True)
class HybridBlocks:
    """A prefix hit of a HybridBlockManager: per group, the same n blocks' worth of tokens."""

    groups: tuple[KVBlocks, ...] = ()

    def __len__(self) -> int:
        return len(self.groups[0]) if self.groups else 0


class HybridBlockManager(_OnePool):
    """Block tables for a model whose layers are of two kinds (Gemma 2 and 3, Qwen's alternating layers): some read
    the whole context, some attend within a sliding window. As vLLM's hybrid allocator does, the layers are dealt
    into groups of one kind and of equal size (the smaller kind's count; a kind's last group may have empty
    places); a block holds one group's keys and values, so every block of the one pool is the same size and any
    group can take any block. Each group has its own table for each sequence: group 0 `seq.block_table`, group
    g `seq.group_tables[g]`, all covering the same tokens block for block. A sliding group gives back the blocks
    behind its window (BlockManager's window) and keeps about window / block_size blocks a sequence however long
    it grows; a whole-context group keeps every block. So a long sequence costs the whole-context layers'
    share of a plain cache's memory, a short one about the plain cost (the empty places aside).

    Every change is made in every group or in none: an allocation is checked against the pool for all groups
    before any takes a block. A prefix hit is the longest prefix that every group holds: every block of it in a
    whole-context group, the blocks its next query reads in a sliding one (BlockManager._window_hit)."""

    def __init__(self, num_blocks: int, windows: tuple[int, ...], block_size: int = 16, enable_caching: bool = True):
        """`windows`: each group's sliding window (0: the whole context); group 0 reads the whole context."""
        if not windows or windows[0] or not any(windows) or len(windows) > 255:
            raise ValueError(f"a hybrid block manager needs a whole-context group 0 and a sliding one, got {windows}")
        self.block_size, self.window = block_size, 0  # `window`: as BlockManager's (not every layer slides)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [BlockManager(num_blocks, block_size, enable_caching, w, self.pool, g)
                       for g, w in enumerate(windows)]

    # ------------------------------------------------------------------ queries
    @property
    def num_window_released(self) -> int:
        return sum(g.num_window_released for g in self.groups)

    def get_computed_blocks(self, seq: Sequence) -> tuple[HybridBlocks, int]:
        first, _ = self.groups[0].get_computed_blocks(seq)
        n = len(first)
        hits: list[KVBlocks] = []
        while n:  # the longest n every group holds: a group's best below n may leave another short; again
            hits = []
            for group in self.groups:
                if group.window:
                    blocks, tokens = group._window_hit(seq.block_hashes[:n])
                else:
                    blocks, tokens = group.get_computed_blocks(seq)
                    blocks, tokens = KVBlocks(blocks.blocks[:n]), min(tokens, n * self.block_size)
                hits.append(blocks)
                if tokens < n * self.block_size:
                    n = tokens // self.block_size
                    break
            else:
                return HybridBlocks(tuple(hits)), n * self.block_size
        return HybridBlocks(), 0

    def free_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed: HybridBlocks = HybridBlocks()) -> int:
        return sum(g.free_blocks_needed(seq, num_new_tokens, c) for g, c in zip(self.groups, _each(computed, self)))

    # ------------------------------------------------------------------ changes
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: HybridBlocks = HybridBlocks()) -> KVBlocks | None:
        """BlockManager.allocate_slots in every group, or None (nothing changed) where the pool is short.
        Returns group 0's new blocks."""
        if not self.has_room(seq, num_new_tokens, computed):
            return None
        hits = _each(computed, self)
        for c in hits:  # every group's hit out of the free queue first: no group's new blocks may evict another's
            self.pool.touch(b for b in c.blocks if b is not self.pool.null_block)
        news = [g.allocate_slots(seq, num_new_tokens, c, touched=True) for g, c in zip(self.groups, hits)]
        assert all(new is not None for new in news)
        return news[0]

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)

    def truncate(self, seq: Sequence) -> None:
        for g in self.groups:
            g.truncate(seq)

    def holds(self, seq: Sequence) -> bool:
        return self.groups[0].holds(seq)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for g in self.groups:
            g._refs(refs)
        self.pool.check_integrity(refs)
        first = self.groups[0]._tables
        owner: dict[int, int] = {}  # block id -> the group whose table holds it (one group only)
        for g in self.groups:
            for table in g._tables.values():
                for b in table:
                    if b is not self.pool.null_block:
                        assert owner.setdefault(b.block_id, g.group) == g.group, \
                            f"block {b.block_id} is in the tables of groups {owner[b.block_id]} and {g.group}"
        for g in self.groups[1:]:
            assert g._tables.keys() == first.keys(), f"group {g.group} holds other sequences than group 0"
            for rid, table in first.items():
                assert len(table) == len(g._tables[rid]), f"{rid}: group {g.group}'s table covers other tokens"


def _each(computed, manager: HybridBlockManager) -> tuple[KVBlocks, ...]:
    if isinstance(computed, HybridBlocks) and computed.groups:
        return computed.groups
    if len(computed):
        raise ValueError("a hybrid manager's prefix hit is a HybridBlocks")
    return (_NO_BLOCKS,) * len(manager.groups)
