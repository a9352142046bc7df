"""The small-op Triton kernels compiled on a CUDA GPU (on sm_90+ launched as programmatic dependents,
kernels/pdl.py), against the torch expressions they replace, eagerly and replayed in a CUDA graph.
Skipped where Triton interprets (tests/conftest.py: on a GPU the interpreter's test files skip instead)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_gpu

from flotilla.kernels import fused, pdl
from flotilla.models.rope import RotaryEmbedding

pytestmark = needs_gpu


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def step(x, delta, norm_w, gate_up, qkv, cos, sin, kc, vc, slots, hq):
    """A decode layer's small ops in their order, each reading the previous one's output."""
    s, h = fused.add_rms_norm(x, delta, norm_w, 1e-5)
    act = fused.silu_mul(gate_up + h[:, :1].to(gate_up.dtype))  # depends on the norm
    q = fused.rope_store_kv(qkv + act[:, :1], cos, sin, hq, kc, vc, slots)
    return s, h, act, q


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_ops_on_the_gpu_eager_and_in_a_graph(dtype):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    T, hq, hkv, d, hidden, inter = 2, 32, 8, 128, 4096, 1100
    x = torch.randn(T, hidden, device=dev, generator=gen).to(dtype)
    delta = torch.randn(T, hidden, device=dev, generator=gen).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, device=dev, generator=gen)).to(dtype)
    gate_up = torch.randn(T, 2 * inter, device=dev, generator=gen).to(dtype)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=dev, generator=gen).to(dtype)
    rope = RotaryEmbedding(d, 64, 500000.0, None).to(dev)
    cos, sin = rope.tables(torch.tensor([3, 40], device=dev), dtype)
    kc = torch.zeros(6, 16, hkv, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([17, 90], device=dev)

    def reference():
        s = x + delta
        h = F.rms_norm(s.float(), (hidden,), norm_w.float(), 1e-5)
        g = gate_up.float() + h[:, :1].to(dtype).float()
        act = F.silu(g[:, :inter]) * g[:, inter:]
        qk_in = (qkv.float() + act[:, :1].to(dtype).float())
        xqk = qk_in[:, :(hq + hkv) * d].view(T, hq + hkv, d)
        qk = xqk * cos.float() + xqk.roll(d // 2, dims=-1) * sin.float()
        return s, h, act, qk[:, :hq], qk[:, hq:], qk_in[:, (hq + hkv) * d:].view(T, hkv, d)

    s_ref, h_ref, act_ref, q_ref, k_ref, v_ref = reference()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3

    def check(outs):
        s, h, act, q = outs
        assert torch.equal(s, s_ref) if dtype == torch.float16 else rel_err(s, s_ref) < tol
        for got, want in ((h, h_ref), (act, act_ref), (q, q_ref), (kc.view(-1, hkv, d)[slots], k_ref),
                          (vc.view(-1, hkv, d)[slots], v_ref)):
            assert rel_err(got, want) < tol

    args = (x, delta, norm_w, gate_up, qkv, cos, sin, kc, vc, slots, hq)
    check(step(*args))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*args)
    for i in range(3):  # fresh inputs: each kernel must read what the one before it wrote in this replay
        for t in (x, delta, gate_up, qkv):
            t.copy_(torch.randn(t.shape, device=dev, generator=gen).to(dtype))
        kc.zero_(), vc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        s_ref, h_ref, act_ref, q_ref, k_ref, v_ref = reference()
        check(outs)
    assert pdl.enabled(x) == (tuple(torch.cuda.get_device_capability()) >= pdl.MIN_CAPABILITY)


def test_step_start_and_greedy_ids_on_the_gpu():
    """The first stage's step start (embedding + the first input norm, one kernel) and the
    one-launch greedy ids, compiled on the GPU: against torch, and the greedy ids over a llama-3
    vocabulary at batch 1 and 16, twice (the scratch goes back to rest)."""
    from flotilla.kernels.triton_sample import first_max_into
    from flotilla.runtime.sampler import chunked_first_max

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(2)
    table = torch.randn(1000, 4096, device=dev, generator=gen).half()
    w = (1 + 0.1 * torch.randn(4096, device=dev, generator=gen)).half()
    tok = torch.tensor([5, 0, 999], device=dev)
    sampled = torch.tensor([17, 0, 0, 0], device=dev)
    rows = torch.tensor([3, 0, 3], device=dev)
    x, y = fused.embed_rms_norm(table, tok, w, 1e-5, sampled, rows)
    ids = torch.tensor([5, 17, 999], device=dev)
    assert torch.equal(x, table[ids])
    assert torch.equal(y, fused.rms_norm(table[ids], w, 1e-5))  # the same math as the norm kernel
    V = 128256
    for B in (1, 16):
        logits = torch.randn(B, V, device=dev, generator=gen)
        logits[0, [9, 128255]] = 99.0  # a tie: the first
        out = torch.empty(B, dtype=torch.int64, device=dev)
        for _ in range(2):
            assert first_max_into(logits, out).tolist() == chunked_first_max(logits, 1002).tolist()
        assert out[0] == 9
