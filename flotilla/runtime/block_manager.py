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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True, window: int = 0):
        self.block_size = block_size
        self.window = window  # every layer's sliding window, in tokens (0: some layer reads the whole context)
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashed: dict[str, int] = {}  # per table: its leading blocks known to hold a hash
        self._dropped: dict[str, int] = {}  # per table: its leading blocks given back (behind the window)
        self.num_window_released = 0  # blocks given back behind a window, since the start

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
            block = self.pool.get_cached_block(h)
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
            block = self.pool.get_cached_block(h)
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
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: KVBlocks = KVBlocks()) -> KVBlocks | None:
        """Make room for `num_new_tokens` more tokens after the sequence's computed ones (plus
        the `computed` prefix hit, for a sequence being admitted). Returns the newly taken blocks,
        or None, changing nothing, when the pool cannot provide them. A decode that stays in its
        last block costs O(1): the table is replaced only when it grows (`seq.block_table` is
        never changed in place, so a step may hold on to it)."""
        table = self._tables.get(seq.request_id)
        total = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        if table is not None and not computed and total <= len(table) * self.block_size:
            new = _NO_BLOCKS  # the slots are in the table already
        else:
            table = table or []
            num_new = max(0, self.blocks_for(total) - len(table) - len(computed))
            if num_new + sum(1 for b in computed.blocks if b.ref_cnt == 0) > self.pool.num_free_blocks:
                return None
            gone = sum(b is self.pool.null_block for b in computed.blocks)  # a window hit's head (_window_hit)
            self.pool.touch(computed.blocks[gone:])
            new = KVBlocks(tuple(self.pool.take(num_new)))
            table = table + list(computed.blocks) + list(new.blocks)
            if gone:
                self._dropped[seq.request_id] = gone
            self._tables[seq.request_id] = table
            seq.block_table = [b.block_id for b in table]
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
        seq.block_table = [b.block_id for b in table]  # a new list: a step may hold on to the old one

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
            self.pool.cache(table[j], hashes[j])

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; its tail is evicted before its head, which other
        requests are likelier to share."""
        table = self._tables.pop(seq.request_id, [])
        self._hashed.pop(seq.request_id, None)
        dropped = self._dropped.pop(seq.request_id, 0)  # the null block stands in for those
        self.pool.release(reversed(table[dropped:]))
        seq.block_table = []

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
        seq.block_table = seq.block_table[:keep]

    def holds(self, seq: Sequence) -> bool:
        return seq.request_id in self._tables

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every block's ref_cnt equals the number of block tables
        that hold it, and each table's ids match its sequence's view."""
        refs: dict[int, int] = {}
        for rid, table in self._tables.items():
            dropped = self._dropped.get(rid, 0)
            assert all(b is self.pool.null_block for b in table[:dropped]), f"{rid}: a released block is still held"
            assert all(b is not self.pool.null_block for b in table[dropped:]), f"{rid}: the null block past the released"
            for b in table[dropped:]:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)
