"""The CUDA dequant-matmul kernels (flotilla/kernels/cuda).

On any machine: the weight layout (pure torch) round-trips to the GPTQ codes, zeros and scales,
and a numpy emulation of the kernel's decode — the same masks, magic exponents and byte
permutations as csrc/wqa16.cuh — placed by the PTX definition of the m16n8k16 B fragment (lane
4g + t holds rows 2t, 2t+1 / 2t+8, 2t+9 of column g) reproduces the reference's dense weight.
That ties the layout to what the tensor cores read without a GPU. With a GPU: every plan of the
kernel against `kernels/reference` on random shapes with odd N, short last groups, act-order,
asymmetric zeros, fp16 and bf16, bias, and CUDA-graph replays.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_gpu

from flotilla.kernels import registry
from flotilla.kernels.cuda import kernel as cuda_kernel
from flotilla.kernels.cuda.layout import UnsupportedCudaLayout, repack, unpack_layout
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups
from flotilla.kernels.reference import dequantize


def weight(k: int, n: int, bits: int, group: int, sym: bool, act_order: bool, seed: int = 0) -> GPTQWeight:
    gen = torch.Generator().manual_seed(seed)
    g = num_groups(k, group)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    zeros = (torch.full((g, n), 1 << (bits - 1), dtype=torch.int32) if sym
             else torch.randint(1, 1 << bits, (g, n), generator=gen, dtype=torch.int32))
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = default_g_idx(k, group)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return GPTQWeight.from_codes(q, zeros, scales, g_idx, bits, group)


CASES = [  # k, n, group, sym, act_order
    (256, 200, 64, True, False),  # odd N (padded to 256)
    (520, 96, 128, False, False),  # short last group (520 = 4 * 128 + 8), asymmetric
    (384, 320, 32, False, True),  # act-order, asymmetric
    (512, 264, -1, True, True),  # one group, act-order
    (1040, 136, 48, True, False),  # a group size that does not divide a tile
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", CASES)
def test_layout_round_trips(bits, case):
    k, n, group, sym, act = case
    w = weight(k, n, bits, group, sym, act)
    lay = repack(w, torch.float16)
    q, z, s = unpack_layout(lay)
    g = w.g_idx.long()
    assert torch.equal(q, w.codes())
    assert torch.equal(z, w.zeros()[g])
    assert torch.equal(s, w.scales.float()[g])
    assert (lay.zeros is None) == sym
    assert lay.k_pad % 256 == 0 and lay.n_pad % 256 == 0


def test_layout_refuses_what_the_kernel_cannot_read():
    with pytest.raises(UnsupportedCudaLayout, match="multiple of 8"):
        repack(weight(260, 64, 8, 4, True, False), torch.float16)
    for group in (40, 16):
        with pytest.raises(UnsupportedCudaLayout, match="multiple of 16"):
            repack(weight(256, 64, 4, group, True, False), torch.float16)
    with pytest.raises(UnsupportedCudaLayout, match="float16 or bfloat16"):
        repack(weight(256, 64, 4, 64, True, False), torch.float32)


# ----------------------------------------------------------------------------------------------
# Emulation of the kernel's decode (wqa16.cuh Deq<T, BITS>::slice), in numpy.

def byte_perm(x: np.ndarray, y: int, sel: int) -> np.ndarray:
    """CUDA __byte_perm(x, y, sel): byte i of the result is byte (sel >> 4i) & 7 of {y, x}."""
    src = [(x >> (8 * b)) & 0xFF for b in range(4)] + [np.full_like(x, (y >> (8 * b)) & 0xFF) for b in range(4)]
    out = np.zeros_like(x)
    for i in range(4):
        out |= src[(sel >> (4 * i)) & 7] << (8 * i)
    return out


def halves(u: np.ndarray, dtype: str) -> np.ndarray:
    """uint32 -> [..., 2] float32 values of its (low, high) 16-bit halves as fp16 or bf16."""
    lo, hi = u & 0xFFFF, u >> 16
    if dtype == "fp16":
        return np.stack([lo.astype(np.uint16).view(np.float16), hi.astype(np.uint16).view(np.float16)], -1).astype(np.float32)
    return np.stack([(lo << 16).astype(np.uint32).view(np.float32), (hi << 16).astype(np.uint32).view(np.float32)], -1)


def round_to(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return v.astype(np.float16).astype(np.float32)
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16  # round to nearest even
    return b.astype(np.uint32).view(np.float32)


def emulate(lay, dtype: str) -> np.ndarray:
    """The dense [k_pad, n_pad] weight the kernel feeds to its MMAs, in kernel row order."""
    words = lay.words.numpy().astype(np.int64) & 0xFFFFFFFF  # [KK, C, U, 32, 4]
    kk, nc = words.shape[:2]
    w = words.transpose(0, 1, 3, 2, 4).reshape(kk, nc, 32, -1).astype(np.uint32)  # lane's words in order
    slices = np.arange(kk)
    group = (slices.astype(np.uint64) * np.uint64(lay.group_magic) >> np.uint64(32)).astype(np.int64)
    assert np.array_equal(group, slices * 16 // lay.group_size)  # the magic division is exact
    scales = lay.scales.float().numpy()[group]  # [KK, C, 8 g, 8 i]
    zeros = (lay.zeros.float().numpy()[group] if lay.zeros is not None
             else np.full_like(scales, lay.zero_const))
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    s = scales[:, :, g, :]  # [KK, C, 32, 8 tiles]
    z = zeros[:, :, g, :]
    frag = np.zeros((kk, nc, 32, 8, 2, 2), dtype=np.float32)  # tile, register, half
    if lay.bits == 4:
        for j in range(4):
            u = w[..., j]
            a, b = 2 * j, 2 * j + 1
            if dtype == "fp16":
                v = u >> 8
                p0 = halves((u & 0x000F000F) | 0x64006400, dtype) - (1024 + z[..., a, None])
                p1 = halves((u & 0x00F000F0) | 0x64006400, dtype) * 0.0625 - (64 + z[..., b, None])
                p2 = halves((v & 0x000F000F) | 0x64006400, dtype) - (1024 + z[..., a, None])
                p3 = halves((v & 0x00F000F0) | 0x64006400, dtype) * 0.0625 - (64 + z[..., b, None])
            else:
                p0, p1, p2, p3 = (halves(((u >> sh) & 0x000F000F) | 0x43004300, dtype) - (128 + z[..., c, None])
                                  for sh, c in ((0, a), (4, b), (8, a), (12, b)))
            frag[..., a, 0, :], frag[..., b, 0, :] = p0 * s[..., a, None], p1 * s[..., b, None]
            frag[..., a, 1, :], frag[..., b, 1, :] = p2 * s[..., a, None], p3 * s[..., b, None]
    else:
        for i in range(8):
            u = w[..., i]
            if dtype == "fp16":
                lo = halves(byte_perm(u, 0x64646464, 0x4140), dtype) - (1024 + z[..., i, None])
                hi = halves(byte_perm(u, 0x64646464, 0x4342), dtype) - (1024 + z[..., i, None])
            else:
                f = [byte_perm(u, 0x4B000000, 0x7440 + r).view(np.float32) - (8388608.0 + z[..., i]) for r in range(4)]
                lo, hi = np.stack(f[:2], -1), np.stack(f[2:], -1)
            frag[..., i, 0, :], frag[..., i, 1, :] = lo * s[..., i, None], hi * s[..., i, None]
    frag = round_to(frag, dtype)
    # PTX m16n8k16 B fragment: register r, half e of lane 4g + t -> row 2t + e + 8r, column g
    out = np.zeros((kk, 16, nc, 64), dtype=np.float32)
    tile, reg, half = np.meshgrid(np.arange(8), np.arange(2), np.arange(2), indexing="ij")
    for ln in range(32):
        rows = 2 * t[ln] + half + 8 * reg
        cols = 8 * tile + g[ln]
        out[:, rows, :, cols] = frag[:, :, ln, tile, reg, half].transpose(2, 3, 4, 0, 1)
    return out.reshape(kk * 16, nc * 64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES[:3])
def test_emulated_decode_matches_reference(bits, dtype, case):
    k, n, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=1)
    tdtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    lay = repack(w, tdtype)
    dense = emulate(lay, dtype)[:k, :n]
    if lay.perm is not None:
        unsorted = np.empty_like(dense)
        unsorted[lay.perm.numpy()] = dense
        dense = unsorted
    g = w.g_idx.long()
    scale = w.scales.to(tdtype).float()[g]  # the kernel multiplies by the scale in its own dtype
    ref = ((w.codes() - w.zeros()[g]).float() * scale).to(tdtype).float().numpy()
    np.testing.assert_array_equal(dense, ref)
    if dtype == "fp16":  # and that is the reference dequantization, bit for bit
        np.testing.assert_array_equal(dense, dequantize(w, torch.float16).float().numpy())


def test_plans_fill_the_resident_slots_once_and_switch_to_dense():
    occupancy = lambda mb, cfg: 2 if mb <= 2 else 1  # noqa: E731
    p = cuda_kernel.choose_plan(1, 4096, 4096, 132, occupancy)
    assert p == cuda_kernel.Plan("fused", 1, cuda_kernel.THIN, 8)  # 32 tiles x 8 = 256 <= 264 slots
    assert p.grid(1, 4096) == 256
    big = cuda_kernel.choose_plan(16, 8192, 28672, 132, occupancy)
    assert big == cuda_kernel.Plan("fused", 1, cuda_kernel.THIN, 1)  # 224 tiles already fill 264 slots
    mid = cuda_kernel.choose_plan(40, 4096, 4096, 132, occupancy)
    assert (mid.mb, mid.cfg, mid.splits) == (3, cuda_kernel.THIN, 4)  # 32 tiles x 4 <= 132 slots
    wide = cuda_kernel.choose_plan(64, 8192, 28672, 132, occupancy)
    assert (wide.cfg, wide.splits) == (cuda_kernel.WIDE, 1)  # 224 narrow tiles would not fit in one wave
    assert cuda_kernel.choose_plan(65, 4096, 4096, 132, occupancy).kind == "dense"


def test_registry_lists_cuda_below_triton_and_never_picks_it_on_cpu():
    assert "cuda" in registry.kernel_names()
    entries = registry._REGISTRY
    assert entries["dense"].priority < entries["cuda"].priority < entries["triton"].priority
    w = weight(256, 64, 4, 64, True, False)
    assert registry.select(w, torch.device("cpu"), torch.float32).name != "cuda"


def test_supports_never_builds_the_library(monkeypatch):
    """The registry asks every entry's `supports` before it picks Triton: that must not run nvcc
    (nor warn); the build waits until the entry is chosen."""
    def no_build(capability):
        raise AssertionError(f"supports() built the library for {capability}")

    monkeypatch.setattr(cuda_kernel.build, "load", no_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cap"])
    assert cuda_kernel.supports(torch.device("cuda:0"), 4) and cuda_kernel.supports("cuda", 8)
    assert not cuda_kernel.supports(torch.device("cuda:0"), 3)
    assert not cuda_kernel.supports(torch.device("cpu"), 4)
    capability["cap"] = (7, 5)  # below sm_80: no cp.async, no bf16 MMA
    assert not cuda_kernel.supports(torch.device("cuda:0"), 4)


# ----------------------------------------------------------------------------------------------
# On the GPU

def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def plans(m: int):
    P = cuda_kernel.Plan
    yield from (P("fused", mb, cfg, splits) for mb, cfg in cuda_kernel.CONFIGS
                if 16 * mb >= min(m, 64) or mb == 4 for splits in (1, 3))
    yield P("dense")


def poison(m: int, n: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of the output's size in the caching allocator, so that a kernel
    that fails to write its output shows NaN instead of a previous call's (correct) result."""
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


@needs_gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_on_every_plan(bits, dtype, case):
    k, n, group, sym, act = case
    w = weight(k, n, bits, group, sym, act, seed=2).to("cuda")
    kern = cuda_kernel.CudaGPTQKernel(w, dtype)
    w32 = dequantize(w, torch.float32)
    tol = 2e-3 if dtype == torch.float16 else 1.2e-2
    for m in (1, 3, 16, 17, 40, 64, 100, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        ref = x.float() @ w32 + bias.float()
        for plan in [None, *plans(m)] if m in (3, 40, 100) else [None]:
            poison(m, n, dtype)
            y = kern(x, bias, plan=plan)
            assert y.shape == (m, n) and bool(torch.isfinite(y).all()), (m, plan)
            assert rel_err(y, ref) < tol, (m, plan or kern.plan_for(m), rel_err(y, ref))
    assert rel_err(kern(x), x.float() @ w32) < tol  # no bias


@needs_gpu
def test_graph_replays_reuse_the_split_counters():
    w = weight(4096, 512, 4, 128, True, False, seed=3).to("cuda")
    kern = cuda_kernel.CudaGPTQKernel(w, torch.float16)
    assert kern.plan_for(1).splits > 1
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    kern(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kern(x)
    ref = x.float() @ dequantize(w, torch.float32)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        ref = x.float() @ dequantize(w, torch.float32)
        graph.replay()
        assert rel_err(y, ref) < 2e-3
    assert int(kern._counters.abs().sum()) == 0


@needs_gpu
def test_forced_through_the_registry_and_results_are_deterministic(monkeypatch):
    monkeypatch.setenv(registry.ENV_KERNEL, "cuda")
    w = weight(2048, 384, 4, 128, False, True, seed=4).to("cuda")
    kern = registry.select(w, torch.device("cuda"), torch.float16)
    assert kern.name == "cuda"
    x = torch.randn(5, 2048, device="cuda", dtype=torch.float16)
    assert torch.equal(kern(x), kern(x))  # split-K sums in a fixed order
