"""Greedy token ids in one launch: each row's first maximum over a large vocabulary.

    first_max_into(logits, out)    logits [B, V] (fp32 or half) -> out[b] = argmax(logits[b]) (int64),
                                   the first index of the maximum, as torch's argmax

One program per (row, chunk of CHUNK logits): it finds its chunk's maximum and first index, and
folds them into the row's key with one atomic max. The key orders by value, then by the smaller
index: the value's float bits mapped to an unsigned order (positive floats: sign bit set; negative:
all bits flipped), times 2^24, plus 2^24 - 1 - index (V < 2^24). The last program of a row to
finish (a counter) takes the key, writes the id into `out` and puts key and counter back to
their resting values, so the scratch needs no clearing launch before the next call.

A NaN logit is passed over (Triton's max ignores it), where torch's argmax would return its index.

This replaces two reduction passes and three small kernels (bench/NOTES-gpu-decode.md) and writes
the ids where the caller wants them (the runner's sampled-ids buffer), so no copy follows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INDEX_BITS = 24
MAX_VOCAB = 1 << _INDEX_BITS
_CHUNK = 1024
_EMPTY = -1  # a key no chunk's key is below (every key is >= 0)


@triton.jit
def _first_max_kernel(x_ptr, stride_x, V, key_ptr, count_ptr, out_ptr, chunks,
                      CHUNK: tl.constexpr, INDEX_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0) + 0.0  # -0.0 -> +0.0: equal floats get one key
    first = tl.min(tl.where(x == m, offs, V), axis=0)  # the chunk's first maximum
    bits = m.to(tl.int32, bitcast=True).to(tl.int64)
    order = tl.where(bits >= 0, bits + 2147483648, -1 - bits)  # float order -> [0, 2^32) integer order
    key = order * (1 << INDEX_BITS) + ((1 << INDEX_BITS) - 1 - first)
    tl.atomic_max(key_ptr + row, key)
    done = tl.atomic_add(count_ptr + row, 1)  # acq_rel: the key's max above is visible to the last program
    if done == chunks - 1:
        best = tl.atomic_xchg(key_ptr + row, -1)  # read the row's key and leave it empty
        tl.store(count_ptr + row, 0)
        tl.store(out_ptr + row, (1 << INDEX_BITS) - 1 - best % (1 << INDEX_BITS))


class FirstMax:
    """The scratch of first_max_into on one device: a key and a counter per row, at rest between calls."""

    def __init__(self, device: torch.device):
        self.device = device
        self.keys = torch.empty(0, dtype=torch.int64, device=device)
        self.counts = torch.empty(0, dtype=torch.int32, device=device)

    def __call__(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, V = logits.shape
        if V >= MAX_VOCAB:
            raise ValueError(f"first_max_into takes vocabularies below {MAX_VOCAB}, got {V}")
        if out.shape != (B,) or out.dtype != torch.int64 or out.stride(0) != 1 or logits.stride(1) != 1:
            raise ValueError(f"first_max_into writes a contiguous int64 [{B}] from row-contiguous logits; got out "
                             f"{out.dtype} {tuple(out.shape)} strides {out.stride()}, logits strides {logits.stride()}")
        if self.keys.numel() < B:  # grown in stream order (the old scratch is freed after the calls using it)
            if logits.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"first_max_into's scratch must grow to {B} rows, which a CUDA graph capture "
                                   "cannot do: call it once at that size before capturing")
            self.keys = torch.full((B,), _EMPTY, dtype=torch.int64, device=self.device)
            self.counts = torch.zeros(B, dtype=torch.int32, device=self.device)
        chunks = triton.cdiv(V, _CHUNK)
        _first_max_kernel[(B, chunks)](logits, logits.stride(0), V, self.keys, self.counts, out, chunks,
                                       CHUNK=_CHUNK, INDEX_BITS=_INDEX_BITS, num_warps=4)
        return out


_scratch: dict[torch.device, FirstMax] = {}


def first_max_into(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b] = the first index of logits[b]'s maximum, in one launch; returns `out`."""
    fm = _scratch.get(logits.device)
    if fm is None:
        fm = _scratch[logits.device] = FirstMax(logits.device)
    return fm(logits, out)
