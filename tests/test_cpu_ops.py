"""The compiled per-layer CPU ops against torch, batch invariance and both ISAs' bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels import fused
from flotilla.kernels.attention import PagedAttentionMetadata, paged_attention
from flotilla.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(build.load() is None, reason="the CPU kernels cannot be compiled here")


def test_norms_and_silu_match_torch_and_are_batch_invariant():
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(7, 100, generator=gen), torch.randn(7, 100, generator=gen)
    w = torch.randn(100, generator=gen)
    y = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (100,), w, 1e-5), rtol=1e-6, atol=1e-6)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (100,), w, 1e-5), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(5, 2 * 70, generator=gen) * 4
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :70]) * gate_up[:, 70:], rtol=2e-6, atol=1e-6)
    for i in range(7):
        assert torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-5), y[i:i + 1])
    qkv = torch.randn(4, 5 * 16 + 8, generator=gen)  # rope reads q and k in place: a strided view
    xs = qkv[:, :80].view(4, 5, 16)
    cos, sin = torch.randn(4, 1, 16, generator=gen), torch.randn(4, 1, 16, generator=gen)
    torch.testing.assert_close(ops.rope(xs, cos, sin), torch.addcmul(xs * cos, xs.roll(8, dims=-1), sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), y)  # what the model calls, on the CPU


def paged_case(lens: list[int], hq: int = 6, hkv: int = 2, d: int = 40, bs: int = 4, seed: int = 1):
    """Decode queries over sequences of `lens` tokens in a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    blocks = 1 + sum(per_seq)  # block 0 is the null block
    ids = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(ids[at:at + n])
        at += n
    width = max(per_seq)
    k_cache = torch.randn(blocks, bs, hkv, d, generator=gen)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, table, torch.tensor(lens)


def reference(q, k_cache, v_cache, table, lens, scale):
    out = []
    hkv = k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        k = k_cache[table[b]].reshape(-1, hkv, k_cache.shape[3])[:n].transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[table[b]].reshape(-1, hkv, k_cache.shape[3])[:n].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)


def test_decode_attention_reads_the_blocks_in_place():
    q, kc, vc, table, lens = paged_case([1, 9, 33, 4])
    got = build.load().decode_attention(q, kc, vc, table, lens, 0.3)
    torch.testing.assert_close(got, reference(q, kc, vc, table, lens, 0.3), rtol=1e-5, atol=1e-5)
    for b in range(4):  # each sequence alone: the same bits
        alone = build.load().decode_attention(q[b:b + 1], kc, vc, table[b:b + 1, :-(-lens[b].item() // 4)],
                                              lens[b:b + 1], 0.3)
        assert torch.equal(alone, got[b:b + 1])
    with pytest.raises(RuntimeError, match="tokens"):
        build.load().decode_attention(q, kc, vc, table, lens * 100, 0.3)


def test_paged_attention_on_the_cpu_uses_the_compiled_decode():
    q, kc, vc, table, lens = paged_case([5, 12])
    meta = PagedAttentionMetadata(slot_mapping=torch.tensor([0, 0]), block_tables=table, seq_lens=lens,
                                  query_lens=torch.tensor([1, 1]), block_size=4, num_decodes=2,
                                  max_decode_seq_len=12, max_prefill_query_len=0, max_prefill_seq_len=0)
    assert meta.plan().cpu_decode is not None
    got = paged_attention(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(got, reference(q, kc, vc, table, lens, 0.25), rtol=1e-5, atol=1e-5)


def test_avx2_and_avx512_ops_agree_bit_for_bit():
    if build.cpu_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512: only one build to test")
    a2, a5 = build.load("avx2"), build.load("avx512")
    x, w = torch.randn(3, 200) * 3, torch.randn(200)
    assert torch.equal(a2.rms_norm(x, w, 1e-6), a5.rms_norm(x, w, 1e-6))
    assert torch.equal(a2.silu_mul(x), a5.silu_mul(x))
    r = torch.randn(3, 4, 64)
    assert torch.equal(a2.rope(r, x[:, None, :64], x[:, None, 64:128]), a5.rope(r, x[:, None, :64], x[:, None, 64:128]))
    q, kc, vc, table, lens = paged_case([17, 40], d=64)
    assert torch.equal(a2.decode_attention(q, kc, vc, table, lens, 0.125), a5.decode_attention(q, kc, vc, table, lens, 0.125))


def test_ready_looks_at_the_tensors_before_building(monkeypatch):
    """A GPU process whose op falls back to torch never compiles the CPU extension (a GGUF model on CUDA
    built it once, ~25 s, for nothing): tensors that are not fp32 on the CPU answer False first."""
    from flotilla.kernels.cpu import ops

    def no_build():
        raise AssertionError("the CPU extension was built")

    monkeypatch.setattr(ops, "_ext", ops._UNDECIDED)
    monkeypatch.setattr(ops, "extension", no_build)
    assert not ops.ready(torch.zeros(4, dtype=torch.float16))
    assert not ops.ready(torch.zeros(4), torch.zeros(4, device="meta"))
