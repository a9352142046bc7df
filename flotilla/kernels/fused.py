"""The small per-layer ops of a decoder step, each one launch on CUDA:

    rms_norm(x, weight, eps)                  x [T, H] -> [T, H]
    add_rms_norm(x, delta, weight, eps)       -> (x + delta, rms_norm(x + delta))
    embed_rms_norm(table, ids, weight, eps, sampled, prev_rows)
                                              -> (table[ids'], rms_norm(table[ids'])), ids' = ids
                                              (+ sampled[prev_rows]): a first stage's step start
    silu_mul(gate_up)                         [T, 2I] -> silu(first half) * second half
    rope(x, cos, sin)                         x [T, H, D] -> x * cos + roll(x, D/2) * sin
    store_kv_slots(key_cache, value_cache, key, value, slot_mapping)
    rope_store_kv(qkv, cos, sin, num_heads, key_cache, value_cache, slot_mapping)
                                              qkv [T, (Hq + 2 Hkv) D] -> q rotated [T, Hq, D], with k
                                              rotated and v stored (rope + store_kv_slots; one launch on CUDA)

On CUDA (fp16/bf16) they run the Triton kernels of flotilla.kernels.triton_fused; on the CPU
(fp32) rms_norm, add_rms_norm, silu_mul and rope run one compiled pass each (flotilla.kernels.cpu.ops). A batch-1
llama-3-8b decode step spends 0.92 ms of its 3.0 ms of GPU time in ~360 small torch kernels
(bench/NOTES-gpu-decode.md); torch's layer-norm kernel alone takes ~5.8 µs for one 4096-wide row,
65 times a step. Elsewhere (fp16/bf16 on a CPU, FLOTILLA_KERNEL=dense or reference, no compiled
CPU kernels), and for inputs the kernels do not take, each function is the torch expression it
stands for. `ENABLED = False` turns the Triton path
off (the GPU benchmark's check compares both).

This module imports nothing of flotilla's.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

ENABLED = importlib.util.find_spec("triton") is not None
_HALF = (torch.float16, torch.bfloat16)


def _on_gpu(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    return (ENABLED and t.is_cuda and t.dtype in _HALF and all(u.dtype == t.dtype for u in tensors)
            and all(u.stride(-1) == 1 for u in tensors))


_cpu_ops = None  # kernels/cpu/ops, imported at first use


def _on_cpu(*tensors: torch.Tensor):
    """flotilla's compiled CPU ops (the extension module of kernels/cpu/ops.py) when they take
    these tensors (fp32 on the CPU, the ops enabled: decided once, at first use), else None."""
    global _cpu_ops
    if _cpu_ops is None:
        from .cpu import ops

        _cpu_ops = ops
    return _cpu_ops.extension() if _cpu_ops.ready(*tensors) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and _on_gpu(x, weight):
        from .triton_fused import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    cpu = _on_cpu(x, weight)
    if cpu is not None:
        return cpu.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def embed_rms_norm(table: torch.Tensor, token_ids: torch.Tensor, weight: torch.Tensor, eps: float,
                   sampled: torch.Tensor | None = None,
                   prev_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A first stage's step start: ids = token_ids [T] (+ sampled[prev_rows], the ids a step before
    sampled on the device), x = table[ids] [T, H], and (x, rms_norm(x)). One launch on CUDA."""
    if (table.dim() == 2 and token_ids.is_cuda and token_ids.dtype == torch.int64 and token_ids.stride(0) == 1
            and _on_gpu(table, weight) and (prev_rows is None or (prev_rows.dtype == sampled.dtype == torch.int64
                                                                   and prev_rows.stride(0) == sampled.stride(0) == 1))):
        from .triton_fused import embed_rms_norm as triton_embed_rms_norm

        return triton_embed_rms_norm(table, token_ids, weight, eps, sampled, prev_rows)
    ids = token_ids if prev_rows is None else token_ids + sampled.index_select(0, prev_rows)
    x = F.embedding(ids, table)
    return x, rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 2 and delta.shape == x.shape and _on_gpu(x, delta, weight):
        from .triton_fused import add_rms_norm as triton_add_rms_norm

        return triton_add_rms_norm(x, delta, weight, eps)
    cpu = _on_cpu(x, delta, weight) if delta.shape == x.shape else None
    if cpu is not None:
        total, normed = cpu.add_rms_norm(x, delta, weight, eps)
        return total, normed
    x = x + delta
    return x, F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    if gate_up.dim() == 2 and _on_gpu(gate_up):
        from .triton_fused import silu_mul as triton_silu_mul

        return triton_silu_mul(gate_up)
    cpu = _on_cpu(gate_up)
    if cpu is not None:
        return cpu.silu_mul(gate_up)
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's MLP activation: gelu(gate) (tanh approximation) * up of [gate | up] [..., 2 I] -> [..., I], in the
    states' dtype as transformers computes it (torch's ops on every device)."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if (x.dim() == 3 and d & (d - 1) == 0 and cos.shape == sin.shape == (x.shape[0], 1, d)
            and _on_gpu(x, cos, sin)):
        from .triton_fused import rope as triton_rope

        return triton_rope(x, cos, sin)
    cpu = (_on_cpu(x, cos, sin) if x.dim() == 3 and x.stride(-1) == 1 and cos.shape == sin.shape == (x.shape[0], 1, d)
           else None)
    if cpu is not None:
        return cpu.rope(x, cos, sin)
    return torch.addcmul(x * cos, x.roll(d // 2, dims=-1), sin)


def store_kv_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into the caches [..., Hkv, D] at flat slots `slot_mapping` [T]."""
    hkv, d = key.shape[1], key.shape[2]
    if (d & (d - 1) == 0 and key_cache.is_contiguous() and value_cache.is_contiguous()
            and _on_gpu(key, value, key_cache, value_cache)):
        from .triton_fused import store_kv as triton_store_kv

        triton_store_kv(key_cache, value_cache, key, value, slot_mapping)
        return
    key_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, value)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q, k and v of one fused projection qkv [T, (Hq + 2 Hkv) D]: k and v written into the caches
    [..., Hkv, D] at flat slots `slot_mapping` [T] (k rotated), q rotated returned [T, Hq, D]; exactly
    rope of q and k, then store_kv_slots."""
    T = qkv.shape[0]
    hkv, d = key_cache.shape[-2], key_cache.shape[-1]
    if (qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * hkv) * d and d & (d - 1) == 0
            and cos.shape == sin.shape == (T, 1, d) and key_cache.is_contiguous() and value_cache.is_contiguous()
            and _on_gpu(qkv, cos, sin, key_cache, value_cache)):
        from .triton_fused import rope_store_kv as triton_rope_store_kv

        return triton_rope_store_kv(qkv, cos, sin, num_heads, key_cache, value_cache, slot_mapping)
    qk = rope(qkv[:, :(num_heads + hkv) * d].view(T, num_heads + hkv, d), cos, sin)  # q and k are adjacent
    store_kv_slots(key_cache, value_cache, qk[:, num_heads:], qkv[:, (num_heads + hkv) * d:].view(T, hkv, d),
                   slot_mapping)
    return qk[:, :num_heads]
