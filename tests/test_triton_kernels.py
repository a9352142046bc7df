"""Triton kernels against the torch references, on CPU tensors through TRITON_INTERPRET=1.

What the interpreter cannot run: inline PTX (`tl.inline_asm_elementwise`). On the GPU the
dequant-matmul decodes word pairs with inline PTX (`triton_gemm.pair_asm`); here the kernels
take their plain-arithmetic decode, which computes the same values, and
`test_pair_asm_constants_decode_exactly` checks the PTX's constants by emulating its
instructions in numpy. Everything else (the layout, split-K with its counters, group runs,
act-order, padding, bias, the dense path, paged attention with splits) runs here as on the GPU.
`bench/kernels.py` checks the PTX path against the reference on the GPU.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import interpreter_only

interpreter_only()  # conftest switched the interpreter on where no GPU is visible
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from flotilla.kernels import registry  # noqa: E402
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups  # noqa: E402
from flotilla.kernels.reference import DenseKernel, dequantize, gptq_matmul  # noqa: E402
from flotilla.kernels.triton_attention import paged_attention_decode  # noqa: E402
from flotilla.kernels.triton_gemm import pair_asm  # noqa: E402
from flotilla.kernels.triton_layout import repack, unpack_layout  # noqa: E402
from flotilla.kernels.triton_linear import GemmConfig, TritonGPTQKernel, dense_chunk, make_kernel  # noqa: E402


def _patch_interpreter() -> None:
    """Two Triton 3.6 interpreter bugs, fixed upstream after the release this project pins:
    numpy >= 2.4 refuses int() of the 1-element arrays the interpreter uses for scalars
    (triton-lang/triton#9171, fixed by #9172), and tl.dot multiplies bf16 operands as their raw
    uint16 storage. Both only affect the interpreter, never compiled kernels."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_flotilla_patched", False):
        return
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = patch_lang_tensor
    dot = interp.InterpreterBuilder.create_dot

    def upcast(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return h

    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, upcast(a), upcast(b), d, *rest)
    interp._flotilla_patched = True


_patch_interpreter()


def random_weight(k: int, n: int, bits: int, group: int, sym: bool, act_order: bool, seed: int = 0) -> GPTQWeight:
    gen = torch.Generator().manual_seed(seed)
    g = num_groups(k, group)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    if sym:
        zeros = torch.full((g, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.randint(1, 1 << bits, (g, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = default_g_idx(k, group)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return GPTQWeight.from_codes(q, zeros, scales, g_idx, bits, group)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


VARIANTS = {  # name: (in_features, out_features, group, sym, act_order)
    "sym-g128": (256, 96, 128, True, False),
    "asym-g128-actorder": (256, 96, 128, False, True),
    "asym-g32-padded": (224, 64, 32, False, False),  # 224 rows: padded to two 128-row blocks
    "sym-perchannel-actorder": (192, 80, -1, True, True),
    "asym-g128-partial-actorder": (320, 64, 128, False, True),  # groups of 128, 128 and 64 (+ padding)
}
CONFIGS = {
    "split-k decode tile": GemmConfig("dot", block_m=16, block_n=32, split_k=2),
    "64-row tile, scale in weights": GemmConfig("dot", block_m=64, block_n=64, split_k=1, scale_w=True),
    "dense": GemmConfig("dense"),
    "dense in chunks": GemmConfig("dense", chunk=32),
}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matmul_matches_reference(bits, dtype, variant):
    k, n, group, sym, act = VARIANTS[variant]
    w = random_weight(k, n, bits, group, sym, act)
    kernel = TritonGPTQKernel(w, dtype)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    for name, cfg in CONFIGS.items():
        for m in (1, 5):
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            y = kernel(x, bias, config=cfg)
            ref = gptq_matmul(x.float(), w) + bias.float()
            assert y.shape == (m, n) and y.dtype == dtype
            assert rel_err(y, ref) < tol, (name, m)


def test_default_configs_cover_every_batch_path():
    w = random_weight(256, 128, 4, 128, False, True, seed=3)
    kernel = TritonGPTQKernel(w, torch.float16)
    kinds = set()
    for m in (1, 16, 33, 100, 1030):
        x = torch.randn(m, 256).half()
        y = kernel(x)
        kinds.add(kernel.config_for(m).kind)
        assert rel_err(y, gptq_matmul(x.float(), w)) < 2e-3, m
    assert kinds == {"dot", "dense"}


def test_group32_layouts_take_the_tuned_256_wide_tiles_at_16_to_64_rows():
    """dot_config's rule for group-32 layouts (the GGUF forms, GPTQ g32) at 16-64 rows gives the winners of
    the H100 tunes (bench/NOTES-kernels.md rounds 19-20): 256-wide tiles, split 2 ways on 4096x14336 and
    8192x28672 (56 and 112 tiles), 8 on 14336x4096 (16 tiles), the scale on the weights from 17 rows; over
    32-row blocks (Q6_K) up to 32 rows twice the programs: 4 ways on 4096x14336, 16 on 14336x4096; g128 keeps
    its rule."""
    from flotilla.kernels.triton_linear import dot_config

    def layout(k, n, rows, block_k=128):
        return SimpleNamespace(in_features=k, out_features=n, k_padded=k, block_k=block_k, rows_per_field=rows)

    for (k, n), split in {(4096, 14336): 2, (8192, 28672): 2, (14336, 4096): 8}.items():
        for m, block_m in ((16, 16), (17, 32), (32, 32), (33, 64), (64, 64)):
            cfg = dot_config(m, layout(k, n, 16), 132)
            assert (cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.scale_w) == (
                block_m, 256, split, 4, m > 16)
        assert dot_config(64, layout(k, n, 32), 132).block_n in (64, 128)  # g128: the 64/128-wide rule
    for (k, n), split in {(4096, 14336): 4, (8192, 28672): 2, (14336, 4096): 16}.items():
        for m in (16, 32):  # Q6_K: 8-bit, group 16; at 64 rows the 0.8-of-the-SMs split as the others
            assert dot_config(m, layout(k, n, 8, block_k=32), 132).split_k == split
    assert [dot_config(64, layout(k, n, 8, block_k=32), 132).split_k for k, n in ((4096, 14336), (14336, 4096))] == [2, 8]
    assert dot_config(40, layout(1536, 576, 16), 132).split_k == 4  # 12 blocks: the largest power of two


def test_dense_from_the_measured_crossover_per_shape():
    """choose_config: dequantize + cuBLAS from 256 rows on small weights, 512 on large (the H200
    crossovers), the Triton tiles below; and the registry's pick at the crossover is right."""
    from flotilla.kernels.triton_linear import choose_config, dense_min_rows

    def layout(k, n):  # only the shape matters to the rule
        return SimpleNamespace(in_features=k, out_features=n, k_padded=k, block_k=256, rows_per_field=32)

    for (k, n), first in {(4096, 4096): 256, (4096, 6144): 256, (14336, 4096): 256, (4096, 28672): 512,
                          (8192, 28672): 512}.items():
        assert dense_min_rows(layout(k, n)) == first
        assert choose_config(first, layout(k, n), 132).kind == "dense"
        assert choose_config(first - 1, layout(k, n), 132).kind == "dot"
    w = random_weight(256, 128, 4, 128, True, False, seed=5)
    kernel = TritonGPTQKernel(w, torch.float16)
    x = torch.randn(256, 256).half()
    assert kernel.config_for(256).kind == "dense"
    assert rel_err(kernel(x), gptq_matmul(x.float(), w)) < 2e-3


def test_leading_dims_and_strided_input():
    w = random_weight(128, 64, 4, 64, True, False, seed=4)
    kernel = TritonGPTQKernel(w, torch.float16)
    x = torch.randn(2, 3, 256).half()[..., ::2]  # a non-contiguous [2, 3, 128] view
    y = kernel(x, config=CONFIGS["split-k decode tile"])
    assert y.shape == (2, 3, 64)
    assert rel_err(y, gptq_matmul(x.float(), w)) < 2e-3


def test_split_k_counters_return_to_zero_and_repeat_exactly():
    w = random_weight(512, 64, 4, 128, False, False, seed=5)
    kernel = TritonGPTQKernel(w, torch.float16)
    cfg = GemmConfig("dot", block_m=16, block_n=32, split_k=4)
    x = torch.randn(3, 512).half()
    first = kernel(x, config=cfg)
    assert int(kernel._counters.abs().sum()) == 0
    second = kernel(x, config=cfg)
    assert torch.equal(first, second)
    assert rel_err(first, gptq_matmul(x.float(), w)) < 2e-3


def _silu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up rounded as kernels/fused.silu_mul's GPU kernel rounds it: silu's output, then the product."""
    inter = gate_up.shape[-1] // 2
    a, b = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    return ((a / (1 + torch.exp(-a))).to(gate_up.dtype).float() * b).to(gate_up.dtype)


@pytest.mark.parametrize("m,cfg", [
    (2, GemmConfig("dot", block_m=16, block_n=32, split_k=2)),   # split-K: the last split's store
    (3, GemmConfig("dot", block_m=16, block_n=64)),               # one split; 80 columns: a partial last tile
    (16, GemmConfig("dot", block_m=8, block_n=32, split_k=2)),  # two row tiles
    (14, GemmConfig("dot", block_m=16, block_n=64, scale_w=True)),  # the scale on the weight side
])
def test_tile_silu_epilogue_is_silu_mul_of_the_product(m, cfg):
    """The Triton tiles' silu epilogue (a tile of gate columns j and up columns I + j, silu(gate) * up
    from its last store) gives what the product then kernels/fused.silu_mul give, from any split
    and row tile, with a partial last tile of columns; it leaves the split-K counters at zero."""
    w = random_weight(256, 160, 4, 128, False, False, seed=6)
    kernel = TritonGPTQKernel(w, torch.float16)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
    kernel._configs[m] = cfg
    assert kernel.gemv is None and kernel.fuses_silu(m)
    y = kernel.silu_mul(x)
    assert y.shape == (m, 80)
    assert int(kernel._counters.abs().sum()) == 0
    ref = _silu_ref(kernel(x))
    # the same values but where the interpreter's exp and torch's differ in the last bit (one fp16 ulp)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=1e-4)


def test_silu_mul_without_an_epilogue_is_silu_mul_of_the_product(monkeypatch):
    """Where no epilogue serves (a bias; past TILE_SILU_MAX_ROWS; FLOTILLA_TILE_SILU=0), silu_mul of a
    [gate | up] weight is kernels/fused.silu_mul of the kernel's product: the same values."""
    from flotilla.kernels.fused import silu_mul
    from flotilla.kernels.triton_linear import TILE_SILU_ENV, TILE_SILU_MAX_ROWS

    w = random_weight(256, 128, 4, 128, False, False, seed=6)
    x = torch.randn(2, 256).half()
    bias = torch.randn(128).half()
    kernel = TritonGPTQKernel(w, torch.float16)
    assert torch.equal(kernel.silu_mul(x, bias), silu_mul(kernel(x, bias)))
    wide = torch.randn(TILE_SILU_MAX_ROWS + 1, 256).half()
    assert kernel.fuses_silu(TILE_SILU_MAX_ROWS) and not kernel.fuses_silu(TILE_SILU_MAX_ROWS + 1)
    assert torch.equal(kernel.silu_mul(wide), silu_mul(kernel(wide)))
    monkeypatch.setenv(TILE_SILU_ENV, "0")
    kernel = TritonGPTQKernel(w, torch.float16)
    assert kernel.gemv is None and not kernel.fuses_silu(1)
    assert torch.equal(kernel.silu_mul(x), silu_mul(kernel(x)))
    assert kernel.silu_mul(x).shape == (2, 64)


def test_scale_in_weights_gives_the_reference_dequantization_exactly():
    """fp16 weight-side scaling rounds (q - z) * s once, like reference.dequantize: an identity
    activation reads the dequantized weight back bit for bit."""
    w = random_weight(128, 32, 4, 32, False, True, seed=6)
    kernel = TritonGPTQKernel(w, torch.float16)
    eye = torch.eye(128).half()
    y = kernel(eye, config=GemmConfig("dot", block_m=64, block_n=32, split_k=1, scale_w=True))
    assert torch.equal(y, dequantize(w, torch.float16))


@pytest.mark.parametrize("bits,group,act", [(4, 128, False), (4, 32, True), (8, 128, True), (8, 32, False), (4, -1, True)])
def test_layout_round_trips_the_codes(bits, group, act):
    w = random_weight(320, 48, bits, group, False, act, seed=7)
    layout = repack(w)
    assert torch.equal(unpack_layout(layout), w.codes())
    assert layout.words.shape == (48, layout.k_padded * bits // 32)
    assert layout.k_padded % layout.block_k == 0 and layout.k_padded >= 320
    assert (layout.perm is not None) == w.has_act_order


def test_irregular_act_order_groups_fall_back_to_dense():
    w = random_weight(128, 32, 4, 32, True, False, seed=8)
    w.g_idx = torch.tensor([0] * 40 + [1] * 24 + [2] * 32 + [3] * 32, dtype=torch.int32)  # 40/24 rows
    assert isinstance(make_kernel(w, torch.float16), DenseKernel)


def test_registry_offers_triton_for_cuda_only():
    names = registry.kernel_names()
    assert "triton" in names
    entry = registry._REGISTRY["triton"]
    assert entry.supports(torch.device("cuda"), 4) and entry.supports(torch.device("cuda"), 8)
    assert not entry.supports(torch.device("cpu"), 4)
    w = random_weight(128, 32, 4, 128, True, False)
    assert not isinstance(registry.select(w, torch.device("cpu"), torch.float16), TritonGPTQKernel)


def _emulate_pair(word: int, asm: str, zero_const: int, scale_bits: int) -> tuple[float, float]:
    """Run pair_asm's instructions on one 32-bit word with numpy fp16 arithmetic."""
    mask, magic = (int(v, 16) for v in re.search(r"lop3\.b32 p, \$2, (0x\w+), (0x\w+), 0xEA", asm).groups())
    p = (word & mask) | magic
    halves = np.array([p & 0xFFFF, p >> 16], dtype=np.uint16).view(np.float16)
    zero = np.array([zero_const, zero_const], dtype=np.uint16).view(np.float16)
    if "fma.rn" in asm:
        sixteenth = np.array([int(re.search(r"mov\.b32 c, (0x\w+)", asm).group(1), 16) & 0xFFFF],
                             dtype=np.uint16).view(np.float16)
        halves = (halves * sixteenth + zero).astype(np.float16)  # exact: powers of two, small ints
    else:
        halves = (halves + zero).astype(np.float16)
    if "mul.rn" in asm:
        halves = (halves * np.array([scale_bits], dtype=np.uint16).view(np.float16)).astype(np.float16)
    return float(halves[0]), float(halves[1])


@pytest.mark.parametrize("bits", [4, 8])
def test_pair_asm_constants_decode_exactly(bits):
    """The fp16 PTX decode gives (q - z) * s for every code and zero (the zero constants are the
    ones load_group builds: -(1024 + z) = 0xE400 | z, and -(64 + z) = 0xD400 + 16 z)."""
    scale = np.float16(0.0137)
    s_bits = int(np.array([scale]).view(np.uint16)[0])
    even = pair_asm(bits, False, True)
    odd = pair_asm(bits, False, True, odd=True)
    assert pair_asm(8, True, False) == "" and pair_asm(4, True, False, odd=True) == ""
    for z in range(1, 1 << bits):
        for lo in range(0, 1 << bits, 3):
            hi = (1 << bits) - 1 - lo
            want = (float(np.float16((lo - z) * scale)), float(np.float16((hi - z) * scale)))
            assert _emulate_pair(lo | (hi << 16), even, 0xE400 | z, s_bits) == want
            if odd:  # the second nibble of each half, read in place
                assert _emulate_pair((lo << 4) | (hi << 20), odd, 0xD400 + 16 * z, s_bits) == want


def _reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(batch, heads, dim)
    for b in range(batch):
        n = int(context_lens[b])
        pages = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[pages].reshape(-1, kv_heads, dim)[:n].float()  # [n, Hkv, D]
        v = v_cache[pages].reshape(-1, kv_heads, dim)[:n].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_matches_reference(dtype, heads, kv_heads, num_splits):
    gen = torch.Generator().manual_seed(11)
    block_size, dim, num_blocks = 16, 64, 24
    context_lens = torch.tensor([1, 37, 130, 16], dtype=torch.int32)
    max_blocks = 9
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    # every sequence gets its own shuffled physical pages; unused table entries stay -1-free zeros
    pages = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros(4, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(context_lens.tolist()):
        count = -(-n // block_size)
        block_tables[b, :count] = pages[used:used + count] if used + count <= num_blocks else pages[:count]
        used += count
    q = torch.randn(4, heads, dim, generator=gen).to(dtype)
    out = paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits=num_splits,
                                 block_n=32)
    ref = _reference_decode(q, k_cache, v_cache, block_tables, context_lens, dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    assert rel_err(out, ref) < tol


def test_paged_attention_rejects_mismatched_heads():
    q = torch.randn(1, 6, 64)
    cache = torch.randn(2, 16, 4, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32))


def test_dense_chunks_where_they_measured_faster():
    assert dense_chunk(2048, 28672) == 4096  # gate_up of llama-3-8b: 7 chunks
    assert dense_chunk(512, 14336) == 4096
    assert dense_chunk(256, 28672) == 0  # below 512 rows one dequantization and one GEMM
    assert dense_chunk(2048, 8192) == 0  # two chunks: the first one's dequantization is not hidden


def test_dense_in_chunks_writes_a_column_slice_and_its_bias():
    w = random_weight(256, 200, 4, 128, False, True, seed=8)  # 200 = 64 + 64 + 64 + 8: a short last chunk
    kernel = TritonGPTQKernel(w, torch.float16)
    x = torch.randn(7, 256).half()
    bias = torch.randn(200).half()
    merged = torch.full((7, 300), float("nan")).half()
    y = kernel(x, bias, config=GemmConfig("dense", chunk=64), out=merged[:, 50:250])
    assert y.data_ptr() == merged[:, 50:250].data_ptr()
    assert rel_err(merged[:, 50:250], gptq_matmul(x.float(), w) + bias.float()) < 2e-3
    assert merged[:, :50].isnan().all() and merged[:, 250:].isnan().all()
    whole = kernel(x, bias, config=GemmConfig("dense"))
    assert torch.equal(merged[:, 50:250], whole)  # the same dequantized weight and GEMM, chunk by chunk
