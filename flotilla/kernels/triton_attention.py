"""Triton paged-attention decode: one new query token per sequence against its paged KV cache.

    out = paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale=None,
                                 num_splits=1)

    q             [B, Hq, D]                      the current token's queries (fp16 / bf16 / fp32)
    k_cache       [num_blocks, block_size, Hkv, D] keys, paged; v_cache the same shape
    block_tables  [B, max_blocks] int32           physical block of each sequence's logical block
    context_lens  [B] int32                       tokens to attend to (>= 1; the new token's own
                                                  key and value must already be in the cache)
    scale         float, default D ** -0.5
    window        > 0: attend to each sequence's last `window` tokens only (sliding window); 0: all
    softcap       > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)
    num_splits    split each sequence's context over this many programs (flash-decoding) and
                  combine them in a second small kernel; 1 for short contexts or large batches
    -> out        [B, Hq, D] in q's dtype

Grouped-query attention: Hq must be a multiple of Hkv; query head h reads kv head h // (Hq / Hkv).
One program serves all query heads of one kv head (their rows padded to 16 for the matrix unit),
so each key and value is read once per sequence. Softmax is the online (running max) form in fp32.
No host synchronisation: lengths are read on the device, so the call can be captured in a graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_args, pdl_enter


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
    scale, window, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, PRECISION: tl.constexpr = "tf32",
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    # The lengths and the block table, and the first run of pages, before the PDL wait: they are the
    # step's inputs, written before its first kernel (a kernel here starts only once the one before
    # the kernel before it has completed), so their two dependent loads leave the critical path
    ctx = tl.load(len_ptr + b)
    first = tl.maximum(ctx - window, 0)  # window: a huge value when there is none
    per_split = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, ctx)
    tok = start + offs_n
    page = tl.load(bt_ptr + b * stride_bt + tok // BLOCK_SIZE, mask=tok < end, other=0).to(tl.int64)
    pdl_enter(PDL)  # programmatic dependent launch on sm_90+ (kernels/pdl.py): q, k and v after it
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        t_ok = tok < end
        slot = tok % BLOCK_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        after = tok + BLOCK_N  # the next run's pages, in flight while this run is computed
        page = tl.load(bt_ptr + b * stride_bt + after // BLOCK_SIZE, mask=after < end, other=0).to(tl.int64)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        if SOFTCAP > 0:  # softcap * tanh(s / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1) (finite for any y)
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / SOFTCAP)) + 1.0))
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # partial (acc, max, sum) per (sequence, head, split) for _combine_kernel
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_G]
        tl.store(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(ws_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(ws_ml_ptr + row * 2 + 1, l_i, mask=g_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(ws_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ws_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh nothing
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, num_splits: int = 1,
                           block_n: int = 64, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention over a paged KV cache (module docstring)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match "
                         f"q {tuple(q.shape)}: expected [num_blocks, block_size, Hkv, {head_dim}] each")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) axis")
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    ws_acc = torch.empty((batch * num_heads * num_splits, head_dim) if split else (1,),
                         dtype=torch.float32, device=q.device)
    ws_ml = torch.empty((batch * num_heads * num_splits * 2) if split else 1, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, ws_acc, ws_ml, scale, window if window > 0 else 1 << 30,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=split, SOFTCAP=float(softcap),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 as fp32 (tf32 rounds to 10 bits)
        num_warps=4, **launch_args(q, batch))
    if split:
        _combine_kernel[(batch, num_heads)](
            ws_acc, ws_ml, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            NUM_SPLITS=num_splits, num_warps=4, **launch_args(q, batch))
    return out
