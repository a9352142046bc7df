"""CUDA graphs for decode steps: one graph per batch bucket, captured when the runner starts.

Any pipeline stage replays them: the first takes token ids, a later one hidden states [n, hidden]
copied into the bucket's static input; the last writes fp32 logits, an earlier one hidden states
[n, hidden] (a view of the bucket's static output).

A decode-only step of B sequences replays the graph of the smallest bucket n >= B; rows B..n-1
are padding. With `max_query_len` q > 1 a step whose sequences bring up to q new tokens each
(a speculative verify step: the decoded token and its drafts) replays too, one row per token:
row r is token r at its own position, with its sequence's block table and a context that ends
at it, so the decode kernel's causal attention per row is exactly the step's (each layer stores
all rows' keys and values before attending). T new tokens take the bucket n >= T. Each bucket owns its static inputs: one int64 device buffer holding

    token_ids [n] | positions [n] | slot_mapping [n] | seq_lens [n] | prev_rows [n] | block_tables [n, W]

(W = blocks of the longest context served) and a pinned host twin. A hybrid cache of G groups of
layers (HybridBlockManager: a table per group) adds the slot mappings of groups 1..G-1 [n] after
prev_rows, and each row's tables of those groups after its block table: [n, G * W]. A step fills the host twin
with numpy, sends it in one asynchronous copy and replays the graph, which writes fp32 logits
[n, vocab] (or, before the last stage, hidden states [n, hidden]) into the bucket's static
output. Nothing here waits on the device: reading the sampled token ids (the sampler's
`tolist`), or a stage's hidden states for the next hop, is the step's one sync.

A row's input token is `token_ids[r] + sampled[prev_rows[r]]`, inside the graph: `sampled` is the
runner's device buffer of the ids the previous launched step sampled (ModelRunner.launch), whose
last entry stays 0. A row whose token the host knows points there (and its token is in
token_ids); a row whose token is still on the device (a decode launched before the previous
step's ids were read) holds 0 in token_ids and the previous step's row in prev_rows.

Only what changed is written and sent: a row's block table is rewritten when its list is a new
object or a new length, and the rows rewritten are sent, a run of consecutive ones at a time. Every caller keeps to that: the engine replaces a sequence's table when it
grows and never changes it in place; a pipeline worker's mirror (pipeline/step_codec.StageSequences)
extends a table in place (a new length) and replaces it when it trims it, since a trim then an
extend can give the same length with other blocks (a preempted sequence back with new blocks).

Padding rows hold token 0 at position 0 with one token of context, and a block table of null
blocks (block 0): their key and value land in slot 0 of the null block, which no real sequence
reads (the Triton kernel stops at each context length; the torch path masks), and their logits
are never read.

What the graph bakes in at capture: the decode kernel's split count (from W, as for a context
of the full W blocks; empty splits cost one tiny program each) and each linear's tile config
for n rows. `DecodeGraphRunner(..., capture=False)` runs the same static-buffer path eagerly,
with no CUDA: the CPU tests check the buffers and the padding through it.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Callable

import numpy as np
import torch

from flotilla.kernels.attention import PagedAttentionMetadata
from flotilla.models.llama import CausalLM

from .kv_cache import KVCache, PagedAttentionBackend

log = logging.getLogger("flotilla.runtime")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_FIELDS = 5  # token ids, positions, slot mapping, seq lens, previous rows (then the block tables)
_MIXED = object()  # a table row that holds no one sequence's list (a step of several tokens a sequence)


def capture_sizes(max_batch: int, buckets: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
    """The buckets that serve batches of 1..max_batch: those below it and the first at or above
    it (larger batches than the largest bucket run eagerly)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    below = [b for b in buckets if b < max_batch]
    above = [b for b in buckets if b >= max_batch]
    return tuple(below + above[:1])


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch` rows, or None."""
    return min((s for s in sizes if s >= batch), default=None)


class DecodeInputs:
    """The static inputs of one bucket: device views into one int64 buffer, a pinned host twin."""

    def __init__(self, size: int, width: int, block_size: int, device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None, no_prev: int = 0, groups: int = 1):
        """`hidden` = (hidden_size, dtype): a later pipeline stage's static input [n, hidden_size].
        `no_prev`: the entry of the sampled-ids buffer that stays 0 (rows whose token is known).
        `groups` > 1: the steps bring the tables of a hybrid cache's groups 1.. too (StepInput.group_tables)."""
        self.size, self.width, self.block_size, self.no_prev = size, width, block_size, no_prev
        self.groups = groups
        self._nf = _FIELDS + groups - 1  # the fields: the other groups' slot mappings after the others
        self._row = width * groups  # a table row: the block table, then the other groups' tables
        numel = size * (self._nf + self._row)
        cuda = device.type == "cuda"
        self.device_buf = torch.zeros(numel, dtype=torch.int64, device=device)
        self.host_buf = torch.zeros(numel, dtype=torch.int64, pin_memory=cuda)
        self._host = self.host_buf.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        n = size
        fields = self.device_buf[:self._nf * n].view(self._nf, n)
        self.token_ids, self.positions, self.slot_mapping, self.seq_lens, self.prev_rows = fields[:_FIELDS]  # [n] each
        rows = self.device_buf[self._nf * n:].view(n, self._row)
        self.block_tables = rows[:, :width]  # [n, W] (a strided view where other groups' tables follow)
        self.group_slot_mappings = list(fields[_FIELDS:])  # [n] each, of groups 1..
        self.group_block_tables = [rows[:, g * width:(g + 1) * width] for g in range(1, groups)]  # [n, W] each
        self.query_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden[0], dtype=hidden[1], device=device) if hidden else None  # [n, H]
        *self._fields, self._tables = self._views()
        # what each table row holds, here and on the device: (the sequence's list, its length),
        # or None for zeros (every row at first)
        self._rows: list[tuple | None] = [None] * n  # per group: (the list, its length)
        self._used = 0  # rows at and past this one are zeros
        self.fill([], [], [], group_tables=[[]] * (groups - 1) if groups > 1 else None)  # all padding

    def _views(self) -> tuple[np.ndarray, ...]:
        n = self.size
        return (*self._host[:self._nf * n].reshape(self._nf, n), self._host[self._nf * n:].reshape(n, self._row))

    def host_views(self) -> tuple[np.ndarray, ...]:
        """(token_ids, positions, slot_mapping, seq_lens, block_tables) of the host twin."""
        tok, pos, slot, lens, _, *_, tables = self._views()
        return tok, pos, slot, lens, tables[:, :self.width]

    def fill(self, token_ids: list[int], starts: list[int], block_tables: list[list[int]],
             query_lens: list[int] | None = None, prev_rows: list[int] | None = None,
             group_tables: list[list[list[int]]] | None = None) -> None:
        """Write one step and send it to the device: sequence b's new tokens (one each, or
        query_lens[b]) sit at positions starts[b], starts[b] + 1, ...; T = len(token_ids) <= size
        rows, one per token, each with its sequence's block table (and its tables of groups 1..:
        given where and only where the inputs have `groups` > 1). `prev_rows` (one token per
        sequence only): per row, the row of the previous launched step whose sampled id is its token
        (token_ids holds 0 there), or -1 (token_ids holds it)."""
        if len(group_tables or ()) != self.groups - 1:
            raise ValueError(f"graph inputs of {self.groups} groups of layers with the tables of "
                             f"{1 + len(group_tables or ())}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy from the host twin (long done: its step was sampled)
        T, bs, W = len(token_ids), self.block_size, self.width
        tok, pos, _, lens, prev = self._fields[:_FIELDS]
        tables, every = self._tables, (block_tables, *(group_tables or ()))
        if query_lens is None or T == len(starts):  # one token per sequence: rows are sequences
            changed = self._write_tables(block_tables, group_tables or [])
            pos[:T] = starts
        else:
            qlens = np.asarray(query_lens, dtype=np.int64)
            seq_of_row = np.repeat(np.arange(len(qlens)), qlens)  # [T]
            first_row = np.cumsum(qlens) - qlens
            pos[:T] = np.asarray(starts, dtype=np.int64)[seq_of_row] + np.arange(T) - first_row[seq_of_row]
            tables.fill(0)
            for g, group in enumerate(every):
                for b, t in enumerate(group):
                    tables[b, g * W:g * W + len(t)] = t
            tables[:T] = tables[seq_of_row]  # sequence tables (rows < B) -> one per token; gather copies
            changed = list(range(max(T, self._used)))
            self._rows = [((_MIXED, 0),) * self.groups] * T + [None] * (self.size - T)  # rows hold no sequence's list now
            self._used = T
        tok[:T], tok[T:] = token_ids, 0
        prev[:] = self.no_prev
        if prev_rows is not None:
            prev[:T] = prev_rows
            prev[:T][prev[:T] < 0] = self.no_prev
        pos[T:] = 0
        s = pos[:T]
        for g in range(self.groups):  # group 0's slot mapping among the fields, the others' after prev_rows
            slot = self._fields[2 if g == 0 else _FIELDS + g - 1]
            slot[:T] = tables[np.arange(T), g * W + s // bs] * bs + s % bs
            slot[T:] = 0
        lens[:T], lens[T:] = s + 1, 1
        self._send(changed)

    def _send(self, rows: list[int]) -> None:
        """Copy the fields and the table rows `rows` (ascending) to the device, a run of consecutive rows at a
        time: a row is G * W ids (a hybrid cache's G groups, W up to 8192 blocks of a long context), so the rows
        in between, unchanged, are not sent again."""
        fields = self._nf * self.size
        self.device_buf[:fields].copy_(self.host_buf[:fields], non_blocking=True)
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            lo, hi = fields + rows[i] * self._row, fields + (rows[j - 1] + 1) * self._row
            self.device_buf[lo:hi].copy_(self.host_buf[lo:hi], non_blocking=True)
            i = j
        if self._copied is not None:
            self._copied.record()

    def set_tokens(self, token_ids: list[int], prev_rows: list[int] | None = None) -> None:
        """Replace the token ids of the step `fill` wrote (same rows): only they go to the device
        (a prepared step whose tokens came later), and `prev_rows` with them if given (see `fill`)."""
        if self._copied is not None:
            self._copied.synchronize()  # fill's copy from the host twin
        T = len(token_ids)
        self._fields[0][:T] = token_ids
        end = T  # token_ids: the buffer's first row
        if prev_rows is not None:
            prev = self._fields[4]
            prev[:T] = prev_rows
            prev[:T][prev[:T] < 0] = self.no_prev
            end = _FIELDS * self.size  # the fields' rows up to prev_rows
        self.device_buf[:end].copy_(self.host_buf[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _write_tables(self, block_tables: list[list[int]], group_tables: list[list[list[int]]] = ()) -> list[int]:
        """Write sequence b's tables into row b, zeros into the rows past them; a row that holds the
        same lists (same objects, same lengths) is left as it is. Returns the rows written, ascending."""
        tables, rows, changed, W = self._tables, self._rows, [], self.width
        for b, t in enumerate(block_tables):
            lists = (t, *(group[b] for group in group_tables))
            held = rows[b]
            if held is not None and all(h is x and n == len(x) for (h, n), x in zip(held, lists)):
                continue
            for g, x in enumerate(lists):
                tables[b, g * W:g * W + len(x)] = x
                tables[b, g * W + len(x):(g + 1) * W] = 0
            rows[b] = tuple((x, len(x)) for x in lists)
            changed.append(b)
        B = len(block_tables)
        for b in range(B, self._used):
            if rows[b] is not None:
                tables[b] = 0
                rows[b] = None
                changed.append(b)
        self._used = B
        return changed

    def metadata(self, slot_mapping: torch.Tensor | None = None,
                 block_tables: torch.Tensor | None = None) -> PagedAttentionMetadata:
        """Attention metadata over the static buffers, as for contexts of up to W blocks (group 0's slot
        mapping and tables, unless others are given)."""
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping if slot_mapping is None else slot_mapping,
            block_tables=self.block_tables if block_tables is None else block_tables, seq_lens=self.seq_lens,
            query_lens=self.query_lens, block_size=self.block_size, num_decodes=self.size,
            max_decode_seq_len=self.width * self.block_size, max_prefill_query_len=0, max_prefill_seq_len=0)

    def group_metadata(self) -> list[PagedAttentionMetadata] | None:
        """The same over the tables of groups 1.. (None for inputs of one group)."""
        if self.groups == 1:
            return None
        return [self.metadata(slots, tables) for slots, tables in zip(self.group_slot_mappings, self.group_block_tables)]


class _Bucket:
    def __init__(self, inputs: DecodeInputs, forward: Callable[[DecodeInputs], torch.Tensor],
                 graph: "torch.cuda.CUDAGraph | None", logits: torch.Tensor):
        self.inputs, self.forward, self.graph, self.logits = inputs, forward, graph, logits

    def replay(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self.forward(self.inputs)
        return self.logits


class DecodeGraphRunner:
    """Decode steps of a model stage through per-bucket CUDA graphs."""

    def __init__(self, model: CausalLM, cache: KVCache, sizes: tuple[int, ...], max_model_len: int,
                 scale: float, capture: bool = True, max_query_len: int = 1, sampled: torch.Tensor | None = None):
        """`max_query_len`: the most new tokens of one sequence in a step the graphs serve (1:
        decodes only; 1 + k: also verify steps of up to k drafts a sequence). `sampled`: the
        runner's int64 device buffer of the last launched step's sampled ids, at least
        max(sizes) + 1 long, whose last entry stays 0 (default: a buffer of zeros)."""
        if max_query_len < 1:
            raise ValueError(f"max_query_len must be at least 1, got {max_query_len}")
        if sampled is None:
            sampled = torch.zeros(max(sizes) + 1, dtype=torch.int64, device=cache.device)
        if sampled.numel() <= max(sizes):
            raise ValueError(f"the sampled-ids buffer has {sampled.numel()} entries; the graphs need {max(sizes) + 1}")
        self.model, self.cache, self.scale, self.sampled = model, cache, scale, sampled
        self.max_query_len = max_query_len
        self.block_size = cache.spec.block_size
        self.width = min(-(-max_model_len // self.block_size), cache.num_blocks)  # W: blocks per sequence
        self.sizes = tuple(sorted(set(sizes)))
        self.pool = None
        self.buckets: dict[int, _Bucket] = {}
        self._staged: tuple[_Bucket, int] | None = None  # (bucket, tokens) of the step `stage` wrote
        start = time.perf_counter()
        for n in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self.buckets[n] = self._capture(n) if capture else self._eager(n)
        log.info("decode graphs for batch sizes %s captured in %.1fs", self.sizes, time.perf_counter() - start)

    def can_run(self, token_ids: list[int], query_lens: list[int], block_tables: list[list[int]]) -> bool:
        """A step of at most max_query_len new tokens a sequence whose tokens fit a bucket and
        whose tables fit the width."""
        return (len(query_lens) == len(block_tables) > 0 and max(query_lens) <= self.max_query_len
                and bucket_for(len(token_ids), self.sizes) is not None
                and max(len(t) for t in block_tables) <= self.width)

    def run(self, token_ids: list[int], starts: list[int], block_tables: list[list[int]],
            query_lens: list[int] | None = None, hidden: torch.Tensor | None = None,
            prev_rows: list[int] | None = None, group_tables: list[list[list[int]]] | None = None) -> torch.Tensor:
        """fp32 logits [T, vocab] on the last stage, else hidden states [T, hidden]: one row per
        new token (a view of the bucket's static output: read it before the next step). A later
        stage passes the previous stage's hidden states [T, hidden] on this device. `prev_rows`:
        see `DecodeInputs.fill` (rows whose token is in `sampled`)."""
        T = len(token_ids)
        self._staged = None  # a staged step's inputs are overwritten
        bucket = self.buckets[bucket_for(T, self.sizes)]
        if bucket.inputs.hidden is not None:
            if hidden is None or hidden.shape[0] != T:
                raise ValueError(f"a stage after the first replays with hidden states for its {T} tokens")
            # from the device, or from pinned host memory (one copy in); rows T.. keep finite stale values
            bucket.inputs.hidden[:T].copy_(hidden, non_blocking=True)
        bucket.inputs.fill(token_ids, starts, block_tables, query_lens, prev_rows, group_tables)
        return bucket.replay()[:T]

    def stage(self, token_ids: list[int], starts: list[int], block_tables: list[list[int]],
              query_lens: list[int] | None = None, group_tables: list[list[list[int]]] | None = None) -> None:
        """Write a first stage's step into its bucket's static inputs ahead of time, its token ids
        still unknown (`run_staged` brings them and replays)."""
        if not self.model.stage.is_first:
            raise ValueError("only a first stage's steps are staged ahead (a later one needs its hidden states)")
        T = len(token_ids)
        self._staged = (self.buckets[bucket_for(T, self.sizes)], T)
        self._staged[0].inputs.fill(token_ids, starts, block_tables, query_lens, group_tables=group_tables)

    def run_staged(self, token_ids: list[int], prev_rows: list[int] | None = None) -> torch.Tensor:
        """The staged step with its token ids (and `prev_rows`, see `DecodeInputs.fill`): the
        output `run` gives (read it before the next step)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[1] != len(token_ids):
            raise ValueError(f"no step of {len(token_ids)} tokens is staged")
        bucket, T = staged
        bucket.inputs.set_tokens(token_ids, prev_rows)
        return bucket.replay()[:T]

    def _forward(self, inputs: DecodeInputs) -> torch.Tensor:
        backend = PagedAttentionBackend(self.cache, inputs.metadata(), self.scale, inputs.group_metadata())
        if self.model.stage.is_first:  # row r's token: token_ids[r] + sampled[prev_rows[r]] (known, or the last step's id)
            h = self.model(inputs.token_ids, inputs.positions, backend, sampled=(self.sampled, inputs.prev_rows))
        else:
            h = self.model(inputs.hidden, inputs.positions, backend)  # [n, hidden]
        return self.model.compute_logits(h) if self.model.stage.is_last else h  # [n, vocab] fp32, or [n, hidden]

    def _inputs(self, n: int) -> DecodeInputs:
        cfg = self.model.config
        hidden = None if self.model.stage.is_first else (cfg.hidden_size, self.cache.spec.dtype)
        return DecodeInputs(n, self.width, self.block_size, self.cache.device, hidden, self.sampled.numel() - 1,
                            groups=max(1, len(self.cache.spec.groups)))

    @torch.inference_mode()
    def _eager(self, n: int) -> _Bucket:
        inputs = self._inputs(n)
        return _Bucket(inputs, self._forward, None, self._forward(inputs))

    @torch.inference_mode()
    def _capture(self, n: int) -> _Bucket:
        inputs = self._inputs(n)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture: compile kernels, pick tile configs
            for _ in range(2):
                self._forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with _collector_paused(), torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(inputs)
        self.pool = graph.pool()
        return _Bucket(inputs, self._forward, graph, logits)


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector run first, then held off while a graph is captured. A collection during
    the capture may free an earlier CUDA graph (one an engine dropped, held in a reference cycle), whose
    destruction is an operation a capturing stream forbids: the capture fails ("operation not permitted
    when stream is capturing", measured building a third engine in one process). torch.cuda.graph no
    longer collects on entry by default."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
