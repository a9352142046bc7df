"""The Triton kernels of the per-layer small ops (RMSNorm alone and after the residual add,
silu * mul, rope, the KV store) against the torch expressions they replace, on CPU tensors
through TRITON_INTERPRET=1; and the dispatching functions are torch's own off CUDA."""
from __future__ import annotations

import pytest

from conftest import interpreter_only

interpreter_only()  # conftest switched the interpreter on where no GPU is visible
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

import test_triton_kernels  # noqa: E402,F401  (patches two Triton 3.6 interpreter bugs on import)

from flotilla.kernels import fused, triton_fused  # noqa: E402
from flotilla.models.rope import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> None:
    """Within two units in the last place of the half type, of the result or of `scale` (the
    size of the terms summed into it): the interpreter truncates fp32 -> bf16 where the GPU
    rounds to nearest, and an fma rounds once where torch may round twice."""
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    err = (got.float() - want.float()).abs()
    scale = want.float().abs() if scale is None else scale.float().abs()
    assert bool((err <= 2 * ulp * scale + 1e-6).all()), f"max err {err.max().item()}"


@pytest.mark.parametrize("rows, width", [(1, 4096), (5, 96)])  # a llama row; a width that is not a power of 2
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_alone_and_after_the_residual_add(rows, width, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    want = F.rms_norm(x.float(), (width,), w.float(), 1e-5)  # the math in fp32
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-5).float(), want, rtol=tol, atol=tol)
    s, y = triton_fused.add_rms_norm(x, delta, w, 1e-5)
    close(s, x + delta, dtype)
    if dtype == torch.float16:
        assert torch.equal(s, x + delta)  # the residual is rounded exactly as torch's add
    torch.testing.assert_close(y.float(), F.rms_norm(s.float(), (width,), w.float(), 1e-5), rtol=tol, atol=tol)


def test_norm_reads_rows_through_their_stride():
    x = torch.randn(3, 256).half()[:, :128]  # row stride 256
    w = torch.ones(128).half()
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-6).float(), F.rms_norm(x.float(), (128,), None, 1e-6),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = (2 * torch.randn(3, 2 * 1100)).to(dtype)  # not a multiple of the block
    want = F.silu(gate_up[:, :1100]) * gate_up[:, 1100:]
    close(triton_fused.silu_mul(gate_up), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_torch_on_a_strided_qkv_view(dtype):
    T, hq, hkv, d = 5, 6, 2, 32
    qkv = torch.randn(T, (hq + 2 * hkv) * d).to(dtype)
    x = qkv[:, :(hq + hkv) * d].view(T, hq + hkv, d)  # q and k, rows strided by the whole qkv row
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([0, 3, 9, 20, 63]), dtype)
    want = torch.addcmul(x * cos, x.roll(d // 2, dims=-1), sin)
    got = triton_fused.rope(x, cos, sin)
    assert got.shape == (T, hq + hkv, d) and got.is_contiguous()
    close(got, want, dtype, scale=(x * cos).abs() + (x.roll(d // 2, dims=-1) * sin).abs())


def test_store_kv_writes_each_token_at_its_slot_and_nothing_else():
    blocks, bs, hkv, d = 6, 4, 2, 16
    kc = torch.zeros(blocks, bs, hkv, d, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(3, 5 * hkv * d).half()  # k and v as strided views, as the model hands them over
    k, v = qkv[:, :hkv * d].view(3, hkv, d), qkv[:, 2 * hkv * d:3 * hkv * d].view(3, hkv, d)
    slots = torch.tensor([5, 22, 8])
    triton_fused.store_kv(kc, vc, k, v, slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k.view(-1, hkv, d)[slots] = k
    want_v.view(-1, hkv, d)[slots] = v
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_is_rope_then_the_store(dtype):
    """One kernel for rope of q and k and the store of k and v: q as rope's, the caches as store_kv's
    of rope's k, nothing else written; the dispatching function's torch path gives the same."""
    T, hq, hkv, d, blocks, bs = 3, 6, 2, 32, 5, 4
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (hq + 2 * hkv) * d + 8, generator=gen).to(dtype)[:, :(hq + 2 * hkv) * d]  # row stride > width
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([1, 7, 30]), dtype)
    if dtype != torch.float32:  # half tables: views of one gather from the joint [P, 2, D] table
        assert cos.stride(0) == sin.stride(0) == 2 * d
        assert torch.equal(cos, rope.cos[[1, 7, 30]].unsqueeze(1).to(dtype))
        assert torch.equal(sin, rope.sin[[1, 7, 30]].unsqueeze(1).to(dtype))
    slots = torch.tensor([5, 17, 2])
    x = qkv[:, :(hq + hkv) * d].view(T, hq + hkv, d)
    qk = triton_fused.rope(x, cos, sin)
    terms = (x * cos).abs() + (x.roll(d // 2, dims=-1) * sin).abs()  # the size of what is summed
    want_k, want_v = torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    triton_fused.store_kv(want_k, want_v, qk[:, hq:], qkv[:, (hq + hkv) * d:].view(T, hkv, d), slots)
    for fn in (triton_fused.rope_store_kv, fused.rope_store_kv):  # the kernel; off CUDA, the torch path
        kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
        q = fn(qkv, cos, sin, hq, kc, vc, slots)
        assert q.shape == (T, hq, d)
        close(q, qk[:, :hq], dtype, scale=terms[:, :hq])
        close(kc.view(-1, hkv, d)[slots], want_k.view(-1, hkv, d)[slots], dtype, scale=terms[:, hq:])
        assert torch.equal(vc, want_v)
        assert not kc.view(-1, hkv, d)[[i for i in range(blocks * bs) if i not in (5, 17, 2)]].any()
        kc2, vc2 = torch.zeros_like(want_k), torch.zeros_like(want_v)  # the tables' strides read right
        assert torch.equal(fn(qkv, cos.contiguous(), sin.contiguous(), hq, kc2, vc2, slots), q)
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


@pytest.fixture
def torch_only_cpu_ops(monkeypatch):
    """FLOTILLA_KERNEL=dense, decided afresh (the CPU ops decide once, at first use)."""
    from flotilla.kernels.cpu import ops

    monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    ops.reset()
    yield
    ops.reset()


def test_off_cuda_the_functions_are_torchs(torch_only_cpu_ops):
    # FLOTILLA_KERNEL=dense keeps the CPU on torch; the compiled CPU ops are tested against
    # torch in tests/test_cpu_ops.py
    x, d, w = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))
    s, y = fused.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d) and torch.equal(y, F.rms_norm(x + d, (64,), w, 1e-5))
    assert torch.equal(fused.silu_mul(x), F.silu(x[:, :32]) * x[:, 32:])
    q, cos, sin = torch.randn(4, 3, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    assert torch.equal(fused.rope(q, cos, sin), torch.addcmul(q * cos, q.roll(4, dims=-1), sin))


@pytest.mark.parametrize("prev", [False, True])
def test_embed_rms_norm_gathers_the_tokens_and_norms_them(prev):
    """A first stage's step start in one kernel: the rows of the table at token_ids (plus the ids
    a step before sampled, through prev_rows), and their RMSNorm, as the torch ops it replaces."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(50, 96, generator=gen).half()
    w = (1 + 0.1 * torch.randn(96, generator=gen)).half()
    tok = torch.tensor([3, 0, 49, 0])
    sampled = torch.tensor([7, 11, 0, 0, 0])  # the last entry stays 0 (rows whose token is known)
    rows = torch.tensor([4, 0, 4, 1]) if prev else None
    ids = tok + sampled.index_select(0, rows) if prev else tok
    x, y = triton_fused.embed_rms_norm(table, tok, w, 1e-5, sampled if prev else None, rows)
    assert torch.equal(x, table[ids])
    torch.testing.assert_close(y.float(), F.rms_norm(table[ids].float(), (96,), w.float(), 1e-5), rtol=2e-3, atol=2e-3)


def test_first_max_into_is_argmax_with_ties_at_the_first():
    """The one-launch greedy ids: ties inside a chunk and across chunks, -inf rows, negative and
    half logits, a row view with a stride, written into the given buffer."""
    from flotilla.kernels.triton_sample import FirstMax

    V = 3000  # three chunks, the last partial
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, V, generator=gen)
    x[0, [7, 1500, 2999]] = 50.0  # across chunks
    x[1, [1024, 1025]] = 50.0  # a chunk's first entries
    x[2] = float("-inf")
    x[2, [2990, 100]] = -3.0
    x[3] = -x[3].abs() - 1  # all negative
    x[4, [5, 6]] = 9.0  # inside a chunk
    x[5] = 0.0
    x[5, 2000] = -0.0  # -0.0 == 0.0: the first zero wins
    want = [7, 1024, 100, int(x[3].argmax()), 5, 0]
    fm = FirstMax(torch.device("cpu"))
    out = torch.full((7,), -5, dtype=torch.int64)
    assert fm(x, out[:6]).tolist() == want and out[6] == -5
    half = x.half()  # rounding makes new ties in row 3: the first of them
    assert fm(half, out[:6]).tolist() == want[:3] + [int(half[3].float().argmax())] + want[4:]  # the scratch is at rest again
    wide = torch.zeros(6, V + 10)
    wide[:, :V] = x
    assert fm(wide[:, :V], out[:6]).tolist() == want  # rows through their stride
    assert fm.counts.tolist() == [0] * 6 and fm.keys.tolist() == [-1] * 6
