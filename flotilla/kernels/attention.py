"""Paged attention over a block-table KV cache: the torch reference (runs on any device).

Cache layout, one pair per layer:

    key_cache, value_cache   [num_blocks, block_size, Hkv, D]

Token p of a sequence lives in block `block_table[p // block_size]` at offset `p % block_size`,
i.e. at flat slot `block_table[p // block_size] * block_size + p % block_size`. Block 0 is the
null block: padding entries of a block table point at it, and so do the entries of blocks given back behind a
sliding window; nothing but padding rows (a CUDA graph's) is written there, and it is never read unmasked.

A step's batch is B sequences. Sequence b brings `query_lens[b]` new tokens, flattened in batch
order into T = sum(query_lens) rows, at positions `seq_lens[b] - query_lens[b] … seq_lens[b] - 1`
(so `seq_lens[b]` counts the tokens in the cache once this step's keys are stored). The first
`num_decodes` sequences are decodes (one new token each); the rest are prefills or prefill
chunks, which may follow a cached prefix.

Two functions make the interface that other backends (a Triton decode kernel on GPU) implement
with the same signatures:

    store_kv(key_cache, value_cache, key, value, meta)      write this step's keys and values
    paged_attention(query, key_cache, value_cache, meta, scale, window=0, softcap=0) -> [T, Hq, D]

`window` > 0 is a sliding window (Mistral, Gemma 3's local layers, Qwen2's upper layers): the token at
position i attends to the keys at positions i - window + 1 … i, as transformers' sliding-window mask and
vLLM's do. Where every layer slides, the block manager gives back the blocks behind the window (the null block
takes their place); the torch path gathers from the first block any query of the step can see, the kernels
read each sequence's window.
`softcap` > 0 (Gemma 2) caps each score s at softcap * tanh(s / softcap) before the softmax: the torch path
then computes the attention itself (`sdpa`).

Per-step index tensors (gather indices, masks) are built once per step by `meta.plan()` and
shared by every layer; the per-layer work is a store, two gathers and one SDPA per group. On
CUDA the decodes go to the Triton kernel (flotilla.kernels.triton_attention), on the CPU (fp32) to
a compiled one (flotilla.kernels.cpu.ops), both reading the blocks in place; prefills stay on SDPA.

This module imports nothing of flotilla's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .fused import store_kv_slots


@dataclass
class PagedAttentionMetadata:
    """What attention needs to know about one step's batch (built once per step, shared by layers).

    The Python ints are given by the caller, who knows them on the host, so nothing here syncs
    with the device."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (the null block)
    seq_lens: torch.Tensor  # [B] int64: tokens in the cache after this step
    query_lens: torch.Tensor  # [B] int64: new tokens of each sequence this step
    block_size: int
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    max_decode_seq_len: int  # max seq_len over the decodes (0 if none)
    max_prefill_query_len: int  # max query_len over the prefills (0 if none)
    max_prefill_seq_len: int  # max seq_len over the prefills (0 if none)
    first_block: int = -1  # one sequence whose blocks are consecutive ids: the first (no gather needed)
    # the smallest position of a decode's query, and of a prefill's first query: under a sliding window no key
    # before (it - window + 1) is read, so the torch path gathers from there (0: from the start)
    min_decode_pos: int = 0
    min_prefill_pos: int = 0
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    def plan(self, dtype: torch.dtype = torch.float32, window: int = 0) -> "_TorchPlan":
        """The step's gathers and masks for layers of this `window` (0: the whole context), built once."""
        if window and window >= max(self.max_decode_seq_len, self.max_prefill_seq_len):
            window = 0  # no sequence of the step is longer than the window: the plain plan serves
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = _TorchPlan(self, dtype, window)
        return plan


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             meta: PagedAttentionMetadata) -> None:
    """Write key/value [T, Hkv, D] into the caches at `meta.slot_mapping` (one Triton kernel on CUDA)."""
    store_kv_slots(key_cache, value_cache, key, value, meta.slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached tokens (this step's
    included, so call `store_kv` first), over the last `window` of them where window > 0.
    query [T, Hq, D] -> [T, Hq, D]."""
    plan = meta.plan(query.dtype, window)
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, hkv, d)  # [slots, Hkv, D]
    flat_v = value_cache.view(-1, hkv, d)
    parts = []
    if meta.num_decodes and plan.triton_decode is not None:  # the kernel gets the window itself (graph-safe)
        parts.append(plan.triton_decode(query[:meta.num_decodes], key_cache, value_cache, scale, window, softcap))
    elif meta.num_decodes and plan.cpu_decode is not None:
        parts.append(plan.cpu_decode(query[:meta.num_decodes], key_cache, value_cache, scale, plan.window, softcap))
    elif meta.num_decodes:
        parts.append(_decode(query[:meta.num_decodes], flat_k, flat_v, plan, scale, softcap))
    if meta.num_prefills:
        parts.append(_prefill(query[meta.num_decodes:], flat_k, flat_v, plan, scale, softcap))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, plan: "_TorchPlan",
            scale: float, softcap: float = 0.0) -> torch.Tensor:
    # One query per sequence; the G query heads that share a kv head become G query rows.
    B, hq, d = q.shape
    hkv = flat_k.shape[1]
    qg = q.view(B, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    k, v = _keys_values(flat_k, flat_v, plan.decode_gather, plan.contiguous)  # [B, Hkv, L, D]
    out = sdpa(qg, k, v, attn_mask=plan.decode_mask, scale=scale, softcap=softcap)  # [B, Hkv, G, D]
    return out.reshape(B, hq, d)


def _prefill(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, plan: "_TorchPlan",
             scale: float, softcap: float = 0.0) -> torch.Tensor:
    # Queries padded to [Bp, Qmax]; key j is visible to query i of sequence b iff
    # j <= start_b + i, where start_b is the number of tokens cached before this step.
    Bp, Q = plan.prefill_shape
    hq, d = q.shape[1], q.shape[2]
    hkv = flat_k.shape[1]
    if plan.prefill_q_index is None:  # one sequence: no padding
        qp = q.view(1, Q, hq, d).transpose(1, 2)
    else:
        qp = q.index_select(0, plan.prefill_q_index.view(-1)).view(Bp, Q, hq, d).transpose(1, 2)  # [Bp, Hq, Q, D]
    k, v = _keys_values(flat_k, flat_v, plan.prefill_gather, plan.contiguous)  # [Bp, Hkv, L, D]
    out = sdpa(qp, k, v, attn_mask=plan.prefill_mask, is_causal=plan.prefill_causal, scale=scale,
               enable_gqa=hq != hkv, softcap=softcap)  # [Bp, Hq, Q, D]
    out = out.transpose(1, 2).reshape(Bp * Q, hq, d)
    return out if plan.prefill_unpad is None else out.index_select(0, plan.prefill_unpad)


SOFTCAP_SCORES = 1 << 25  # fp32 scores (128 MiB) that sdpa's soft-capped path holds at once


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
         softcap: float = 0.0) -> torch.Tensor:
    """torch's scaled_dot_product_attention (q [..., Hq, Q, D], k / v [..., Hkv, S, D]; a bool or additive mask);
    with `softcap` > 0 computed here in fp32, each score s capped at softcap * tanh(s / softcap) before the softmax
    (Gemma 2's soft-capping, which SDPA has no option for)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads: each kv head serves q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    Q, S = q.shape[-2], k.shape[-2]
    if is_causal:  # (as torch's: the queries are the keys' positions, so Q == S)
        if Q != S:
            raise ValueError(f"sdpa: is_causal with {Q} queries over {S} keys; give a mask")
        attn_mask = torch.ones(Q, S, dtype=torch.bool, device=q.device).tril()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kt, vf = k.float().transpose(-1, -2), v.float()
    # the fp32 scores of a long prefill in slices of queries, each [..., rows, S] (a 1024-token chunk over an
    # 8192-token context and 32 heads would be 1 GiB at once)
    rows = max(1, SOFTCAP_SCORES // max(1, S * q[..., :1, :1].numel()))
    out = []
    for a in range(0, Q, rows):
        s = q[..., a:a + rows, :].float() @ kt
        s.mul_(scale / softcap).tanh_().mul_(softcap)
        if attn_mask is not None:
            m = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., a:a + rows, :]
            s = s.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m.float())
        out.append((s.softmax(-1) @ vf).to(q.dtype))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def _keys_values(flat_k: torch.Tensor, flat_v: torch.Tensor, gather: "_Gather", contiguous: slice | None):
    """Each sequence's keys and values [B, Hkv, L, D]: a view of the cache when the batch is one
    sequence in consecutive blocks, else gathered block by block through the block tables."""
    if contiguous is not None:
        return flat_k[contiguous].unsqueeze(0).transpose(1, 2), flat_v[contiguous].unsqueeze(0).transpose(1, 2)
    B, nb = gather.blocks.shape
    hkv, d = flat_k.shape[1], flat_k.shape[2]
    bs = gather.block_size
    k = flat_k.view(-1, bs, hkv, d).index_select(0, gather.blocks.view(-1)).view(B, nb * bs, hkv, d)
    v = flat_v.view(-1, bs, hkv, d).index_select(0, gather.blocks.view(-1)).view(B, nb * bs, hkv, d)
    return k[:, :gather.length].transpose(1, 2), v[:, :gather.length].transpose(1, 2)


@dataclass(frozen=True)
class _Gather:
    blocks: torch.Tensor  # [B, nb] the blocks holding `length` positions of each sequence (from a block's start)
    length: int  # L: the longest sequence of the group, less the positions skipped
    block_size: int


class _TorchPlan:
    """Gather indices and masks for one step, shared by all layers. Masks are additive (0 or
    -inf) so SDPA does not convert them per layer; a lone sequence needs none."""

    def __init__(self, meta: PagedAttentionMetadata, dtype: torch.dtype, window: int = 0):
        bs, nd = meta.block_size, meta.num_decodes
        self.dtype, self.window = dtype, window
        self.triton_decode = _TritonDecode.for_step(meta, window=window) if nd and meta.slot_mapping.is_cuda else None
        self.cpu_decode = _cpu_decode(meta) if nd and dtype == torch.float32 and not meta.slot_mapping.is_cuda else None
        # under a window, the whole blocks before the earliest key any query of the step reads are not gathered
        self.decode_skip = max(0, meta.min_decode_pos - window + 1) // bs if window else 0
        self.prefill_skip = max(0, meta.min_prefill_pos - window + 1) // bs if window else 0
        self.contiguous = None  # slots of the lone sequence, when its blocks are consecutive
        if meta.first_block >= 0:
            n = max(meta.max_decode_seq_len, meta.max_prefill_seq_len)
            # a lone decode over a window reads only the window's keys: the slice's tail; a prefill from its skip
            first = max(0, n - window) if window and not meta.num_prefills else self.prefill_skip * bs
            self.contiguous = slice(meta.first_block * bs + first, meta.first_block * bs + n)
        self.decode_gather = self.decode_mask = None
        self.prefill_q_index = self.prefill_gather = self.prefill_mask = self.prefill_unpad = None
        self.prefill_causal = False
        if nd and self.contiguous is None and self.triton_decode is None:
            self.decode_gather, valid = _gather_index(meta.block_tables[:nd], meta.seq_lens[:nd],
                                                      meta.max_decode_seq_len, bs, self.decode_skip)
            if window:  # key p is visible to the decode at seq_len - 1 iff p > seq_len - 1 - window
                first = self.decode_skip * bs
                valid &= torch.arange(first, first + valid.shape[1], device=valid.device)[None, :] >= \
                    (meta.seq_lens[:nd] - window)[:, None]
            if nd > 1 or window:
                self.decode_mask = _additive(valid, dtype)[:, None, None, :]  # [B, 1, 1, L]
        if meta.num_prefills:
            self._plan_prefill(meta)

    def _plan_prefill(self, meta: PagedAttentionMetadata) -> None:
        bs, nd, Bp = meta.block_size, meta.num_decodes, meta.num_prefills
        qlens, seq_lens = meta.query_lens[nd:], meta.seq_lens[nd:]
        Q, L, device = meta.max_prefill_query_len, meta.max_prefill_seq_len, qlens.device
        self.prefill_shape = (Bp, Q)
        first = self.prefill_skip * bs  # the first key gathered
        if self.contiguous is None:
            self.prefill_gather, _ = _gather_index(meta.block_tables[nd:], seq_lens, L, bs, self.prefill_skip)
        if Bp == 1 and Q == L and not self.window:  # a fresh prompt: plain causal attention
            self.prefill_causal = True
            return
        starts = torch.cumsum(qlens, 0) - qlens  # first row of each sequence among the prefill rows
        i = torch.arange(Q, device=device)
        q_valid = i[None, :] < qlens[:, None]  # [Bp, Q]
        # key j is visible to query i iff j <= (tokens cached before the step) + i. Padding
        # queries see the first key gathered only, so that no mask row is empty (SDPA gives NaN for one).
        last_visible = torch.where(q_valid, (seq_lens - qlens)[:, None] + i[None, :], first)  # [Bp, Q]
        j = torch.arange(first, L, device=device)
        visible = j[None, None, :] <= last_visible[:, :, None]  # [Bp, Q, L]
        if self.window:  # and key j > (the query's position) - window; a padding query keeps key 0
            visible &= j[None, None, :] > last_visible[:, :, None] - self.window
        self.prefill_mask = _additive(visible, self.dtype)[:, None]  # [Bp, 1, Q, L]
        if Bp > 1:
            self.prefill_q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
            tp = meta.slot_mapping.shape[0] - meta.num_decodes  # rows of the padded output that are real queries
            rows = torch.arange(tp, device=device)
            seq = torch.searchsorted(torch.cumsum(qlens, 0), rows, right=True)  # [Tp] owning sequence
            self.prefill_unpad = seq * Q + rows - starts[seq]


class _TritonDecode:
    """The decodes of one step through the Triton paged-attention kernel (int32 tables and
    lengths converted once per step; split-K over the context when the batch is too small to
    fill the GPU)."""

    def __init__(self, kernel, tables: torch.Tensor, lens: torch.Tensor, num_splits: int):
        self.kernel, self.tables, self.lens, self.num_splits = kernel, tables, lens, num_splits

    @classmethod
    def for_step(cls, meta: PagedAttentionMetadata, sms: int | None = None, window: int = 0) -> "_TritonDecode | None":
        """(`window`: the layers' sliding window, which bounds what a sequence reads: the splits follow it.)"""
        try:
            from .triton_attention import paged_attention_decode
        except ImportError:  # no Triton: the torch path
            return None
        nd = meta.num_decodes
        if sms is None:
            sms = torch.cuda.get_device_properties(meta.slot_mapping.device).multi_processor_count
        longest = min(meta.max_decode_seq_len, window) if window else meta.max_decode_seq_len
        splits = max(1, min(16, longest // 512, sms // max(1, nd)))
        return cls(paged_attention_decode, meta.block_tables[:nd].to(torch.int32),
                   meta.seq_lens[:nd].to(torch.int32), splits)

    def __call__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                 window: int = 0, softcap: float = 0.0):
        return self.kernel(q, key_cache, value_cache, self.tables, self.lens, scale=scale, num_splits=self.num_splits,
                           window=window, softcap=softcap)


def _cpu_decode(meta: PagedAttentionMetadata):
    from .cpu.ops import CpuDecode

    return CpuDecode.for_step(meta)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _gather_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, bs: int, skip: int = 0):
    """What to gather for positions skip * bs … max_len - 1 of each sequence (whole blocks: the first `skip` are
    left out), and which positions are valid (< seq_len). Blocks past a sequence's end, or given back behind
    its window, are the null block or stale ones: safe to read, and masked out."""
    nb = -(-max_len // bs)
    blocks = block_tables[:, skip:nb].contiguous()  # [B, nb - skip]
    pos = torch.arange(skip * bs, max_len, device=block_tables.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, max_len - skip * bs]
    return _Gather(blocks, max_len - skip * bs, bs), valid
