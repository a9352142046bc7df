"""Triton kernels for the small per-layer ops of a decode step, each one launch where torch takes
one to three (flotilla.kernels.fused dispatches to them on CUDA):

    rms_norm(x, weight, eps)               x [T, H] -> [T, H]
    embed_rms_norm(table, token_ids, weight, eps, sampled, prev_rows)
                                           -> (table[ids], rms_norm(table[ids])), ids = token_ids
                                           (+ sampled[prev_rows]): a first stage's step start
    add_rms_norm(x, delta, weight, eps)    -> (x + delta, rms_norm(x + delta))
    silu_mul(gate_up)                      [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:]
    rope(x, cos, sin)                      x [T, H, D], cos/sin [T, 1, D] (sin signed, full width)
                                           -> x * cos + roll(x, D/2) * sin
    store_kv(key_cache, value_cache, key, value, slot_mapping)
    rope_store_kv(qkv, cos, sin, num_heads, key_cache, value_cache, slot_mapping)
                                           qkv [T, (Hq + 2 Hkv) D]: q rotated -> [T, Hq, D]; k rotated
                                           and v written into the caches (rope + store_kv, one launch)

Each rounds where the torch expression it replaces rounds (half-precision intermediates where
torch keeps them, fp32 arithmetic inside one op), so results agree with torch's to the last
place or one unit of it. No host synchronisation: all can be captured in a CUDA graph. On sm_90+
each is launched as a programmatic dependent (kernels/pdl.py): it waits for the kernel before it
first thing, then lets the next kernel (the CUDA GEMV, whose weight loads do not wait) launch. The norms load their
weight before that wait (nothing in the step writes it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_args, pdl_enter


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, s_ptr, stride_x, stride_d, stride_y, stride_s, n, eps,
                     BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    # the weight first: no kernel writes it, so under PDL its load overlaps the kernel before
    # instead of following the reduction on the step's critical path
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_ADD:  # the residual stream stays in the activation dtype, rounded as torch's add
        x = (x.to(tl.float32) + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + offs, x, mask=mask)
    tl.store(y_ptr + row * stride_y + offs, _normed(x, w, n, eps).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed(x, w, n, eps):
    """RMSNorm of one row x (masked entries 0) times the fp32 weight w, in fp32."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    return xf * rstd * w


@triton.jit
def _embed_rms_norm_kernel(table_ptr, tok_ptr, samp_ptr, prev_ptr, w_ptr, x_ptr, y_ptr, stride_t, stride_x,
                           stride_y, n, eps, BLOCK: tl.constexpr, HAS_PREV: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(tok_ptr + row)
    if HAS_PREV:  # a token the step before sampled on the device: tok holds 0, prev the row of its id
        tok += tl.load(samp_ptr + tl.load(prev_ptr + row))
    x = tl.load(table_ptr + tok * stride_t + offs, mask=mask, other=0.0)
    tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    tl.store(y_ptr + row * stride_y + offs, _normed(x, w, n, eps).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (a / (1.0 + tl.exp(-a))).to(y_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu's output
    tl.store(y_ptr + row * stride_y + offs, (silu * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(row, cos_ptr, sin_ptr, t, stride_ct, stride_st, mask, D: tl.constexpr):
    """Head rows at `row` ([BLOCK_H, 1] pointers to their first element) of token t: (x, x * cos +
    roll(x, D/2) * sin in fp32, x * cos rounded to x's dtype first, as torch rounds it before addcmul)."""
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xr = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)
    a = (x.to(tl.float32) * c[None, :]).to(x.dtype).to(tl.float32)
    return x, a + xr * s[None, :]


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_yt, stride_yh,
                 heads, D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (h < heads)[:, None]
    _, rotated = _rotate(x_ptr + t * stride_xt + h[:, None] * stride_xh, cos_ptr, sin_ptr, t, stride_ct, stride_st,
                         mask, D)
    out = rotated.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * stride_yt + h[:, None] * stride_yh + d[None, :], out, mask=mask)


@triton.jit
def _rope_store_kernel(x_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, stride_xt, stride_ct, stride_st,
                       hq, hkv, D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Rows h of qkv [T, Hq + 2 Hkv, D]: q heads (rotated into q [T, Hq, D]), k heads (rotated into the
    key cache at the token's slot), v heads (copied into the value cache): _rope_kernel's arithmetic."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    ok = (h < hq + 2 * hkv)[:, None]
    x, rotated = _rotate(x_ptr + t * stride_xt + h[:, None] * D, cos_ptr, sin_ptr, t, stride_ct, stride_st, ok, D)
    rotated = rotated.to(q_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    is_q, is_v = (h < hq)[:, None], (h >= hq + hkv)[:, None]
    kv_head = tl.where(h >= hq + hkv, h - hq - hkv, h - hq)  # (negative on q rows, which store no k or v)
    dst = slot * hkv * D + kv_head[:, None] * D + d[None, :]  # the caches are contiguous [slots, Hkv, D]
    tl.store(q_ptr + t * hq * D + h[:, None] * D + d[None, :], rotated, mask=ok & is_q)
    tl.store(kc_ptr + dst, rotated, mask=ok & ~is_q & ~is_v)
    tl.store(vc_ptr + dst, x, mask=ok & is_v)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     heads, D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (h < heads)[:, None]
    dst = slot * heads * D + h[:, None] * D + d[None, :]  # the caches are contiguous [slots, Hkv, D]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match rows of {n} features")
    y = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else y
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, y, s, x.stride(0),
        delta.stride(0) if delta is not None else 0, y.stride(0), s.stride(0), n, eps,
        BLOCK=block, HAS_ADD=delta is not None, num_warps=max(1, min(16, block // 512)),
        **launch_args(x, rows))
    return s, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[1]


def embed_rms_norm(table: torch.Tensor, token_ids: torch.Tensor, weight: torch.Tensor, eps: float,
                   sampled: torch.Tensor | None = None, prev_rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = token_ids.shape[0], table.shape[1]
    if weight.shape != (n,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match rows of {n} features")
    x = torch.empty((rows, n), dtype=table.dtype, device=table.device)
    y = torch.empty_like(x)
    has_prev = prev_rows is not None
    block = triton.next_power_of_2(n)
    _embed_rms_norm_kernel[(rows,)](
        table, token_ids, sampled if has_prev else token_ids, prev_rows if has_prev else token_ids, weight, x, y,
        table.stride(0), x.stride(0), y.stride(0), n, eps, BLOCK=block, HAS_PREV=has_prev,
        num_warps=max(1, min(16, block // 512)), **launch_args(x, rows))
    return x, y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if delta.shape != x.shape:
        raise ValueError(f"residual {tuple(x.shape)} and delta {tuple(delta.shape)} differ")
    return _norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    inter = width // 2
    y = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, y, gate_up.stride(0), y.stride(0), inter,
                                                         BLOCK=block, num_warps=4, **launch_args(gate_up, rows))
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T, heads, D = x.shape
    if D & (D - 1) or cos.shape != (T, 1, D) or sin.shape != (T, 1, D):
        raise ValueError(f"rope needs a power-of-2 head size and cos/sin [T, 1, D]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}")
    y = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    block_h = min(8, triton.next_power_of_2(heads))
    _rope_kernel[(T, triton.cdiv(heads, block_h))](
        x, cos, sin, y, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), y.stride(0), y.stride(1), heads,
        D=D, BLOCK_H=block_h, num_warps=4, **launch_args(x, T))
    return y


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    T, heads, D = key.shape
    if D & (D - 1) or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous caches and a power-of-2 head size")
    _store_kv_kernel[(T,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0), key.stride(1),
                           value.stride(0), value.stride(1), heads, D=D, BLOCK_H=triton.next_power_of_2(heads),
                           num_warps=4, **launch_args(key, T))


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    T, width = qkv.shape
    hkv, D = key_cache.shape[-2], key_cache.shape[-1]
    if (D & (D - 1) or width != (num_heads + 2 * hkv) * D or qkv.stride(1) != 1 or cos.shape != (T, 1, D)
            or sin.shape != (T, 1, D) or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        raise ValueError(f"rope_store_kv needs qkv [T, (Hq + 2 Hkv) D] with unit column stride, cos/sin [T, 1, D], "
                         f"contiguous caches [..., Hkv, D] and a power-of-2 D; got qkv {tuple(qkv.shape)}, "
                         f"{num_heads} query heads, caches {tuple(key_cache.shape)}, cos {tuple(cos.shape)}")
    q = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    block_h = 8
    _rope_store_kernel[(T, triton.cdiv(num_heads + 2 * hkv, block_h))](
        qkv, cos, sin, q, key_cache, value_cache, slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0),
        num_heads, hkv, D=D, BLOCK_H=block_h, num_warps=4, **launch_args(qkv, T))
    return q
