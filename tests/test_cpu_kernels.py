"""flotilla's compiled CPU kernels against the torch reference, and their batch invariance."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flotilla.kernels import registry
from flotilla.kernels.cpu import build, compact_linear, cpu_gptq_kernel, half_linear, plain_linear
from flotilla.kernels.cpu.packing import pack_float, pack_gptq, pack_half
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups, pack_cols
from flotilla.kernels.reference import DenseKernel, dequantize, gptq_matmul

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(build.load() is None, reason="the CPU kernels cannot be compiled here")


def random_gptq(k: int, n: int, bits: int, group_size: int, sym: bool, act_order: str = "none",
                seed: int = 0) -> GPTQWeight:
    """act_order: "none", "perm" (GPTQ's desc_act: a permutation of the plain groups) or
    "uneven" (each input in a random group: uneven and possibly empty groups)."""
    gen = torch.Generator().manual_seed(seed)
    groups = num_groups(k, group_size)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    if sym:
        zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.randint(1, 1 << bits, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = default_g_idx(k, group_size)
    if act_order == "perm":
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    elif act_order == "uneven":
        g_idx = torch.randint(0, groups, (k,), generator=gen, dtype=torch.int32)
    return GPTQWeight.from_codes(q, zeros, scales, g_idx, bits, group_size)


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w_dense: torch.Tensor, bias=None) -> None:
    """|y - x @ W| within fp32 rounding of the sum: 1e-5 of sum |x| |W| (a wrong code, zero,
    scale or permutation is off by whole weights, orders of magnitude more)."""
    exact = x.double() @ w_dense.double()
    if bias is not None:
        exact = exact + bias.double()
    bound = 1e-5 * (x.double().abs() @ w_dense.double().abs()) + 1e-6
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


CONFIGS = [  # bits, group size, sym, act order
    (bits, gs, sym, act)
    for bits, gs, sym, act in itertools.product((4, 8), (-1, 32, 64), (True, False), ("none", "perm"))
] + [(4, 64, False, "uneven"), (8, 32, True, "uneven"), (4, 40, True, "none"), (8, 24, False, "perm"),
       (4, 128, False, "perm")]  # 200 = 128 + 72: a partial last group


@pytest.mark.parametrize("bits,group_size,sym,act_order", CONFIGS)
def test_gptq_matches_reference_and_is_batch_invariant(bits, group_size, sym, act_order):
    k, n = 200, 72  # n: two full tiles and a partial one (8 columns), k: a group that is cut short
    w = random_gptq(k, n, bits, group_size, sym, act_order)
    kernel = cpu_gptq_kernel(w)
    dense = dequantize(w, torch.float64)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = kernel(x, bias)
    assert_close_to_exact(y, x, dense, bias)
    assert_close_to_exact(kernel(x), x, dense)
    ref = gptq_matmul(x, w, bias)  # the fp32 reference kernel itself
    assert (y - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    # every row alone, and inside batches of every size that hits a different row block
    for m in (1, 2, 5, 6, 7, 13):
        assert torch.equal(kernel(x[:m], bias), y[:m])
    for i in range(40):
        assert torch.equal(kernel(x[i:i + 1], bias), y[i:i + 1])


def test_gptq_zero_of_sixteen_and_all_shapes_of_x():
    """A stored zero field of 15 reads as 16 (GPTQ's +1 without masking)."""
    k, n = 64, 24
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    w = GPTQWeight(qweight=GPTQWeight.from_codes(q, torch.ones(2, n, dtype=torch.int32), torch.ones(2, n).half(),
                                                 default_g_idx(k, 32), 4, 32).qweight,
                   qzeros=pack_cols(torch.full((2, n), 15, dtype=torch.int32), 4),
                   scales=(torch.rand(2, n, generator=gen) + 0.5).half(), g_idx=default_g_idx(k, 32), bits=4,
                   group_size=32)
    assert int(w.zeros().max()) == 16
    kernel = cpu_gptq_kernel(w)
    x = torch.randn(2, 3, k, generator=gen)
    y = kernel(x)
    assert y.shape == (2, 3, n)
    assert_close_to_exact(y.view(6, n), x.view(6, k), dequantize(w, torch.float64))
    wide = torch.randn(5, 2 * k, generator=gen)
    assert torch.equal(kernel(wide[:, :k]), kernel(wide[:, :k].contiguous()))  # a strided x
    assert kernel(torch.empty(0, k)).shape == (0, n)


def test_results_do_not_depend_on_the_thread_count():
    w = random_gptq(576, 1536, 4, 64, False, "perm")
    kernel = cpu_gptq_kernel(w)
    x = torch.randn(9, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_avx2_build_gives_the_same_bits_as_avx512():
    if build.cpu_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512: only one build to test")
    avx2 = build.load("avx2")
    assert avx2 is not None and avx2.isa() == "avx2" and build.load("avx512").isa() == "avx512"
    x = torch.randn(11, 200)
    weight = torch.randn(72, 200)
    packs = [pack_gptq(random_gptq(200, 72, bits, 32, sym, "perm")) for bits, sym in ((4, True), (4, False), (8, False))]
    for packed in packs + [pack_half(weight.half().float()), pack_float(weight)]:
        for m in (1, 3, 11):
            assert torch.equal(packed.build(avx2)(x[:m]), packed.build(build.load("avx512"))(x[:m]))


def test_half_linear_only_for_weights_exact_in_fp16():
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(100, 72, generator=gen) * 0.05).half().float()  # [out, in], exact in fp16
    bias = torch.randn(100, generator=gen)
    f = half_linear(weight)
    assert f is not None and f.name == "fp16" and f.nbytes < weight.nbytes
    x = torch.randn(20, 72, generator=gen)
    y = f(x, bias)
    assert_close_to_exact(y, x, weight.t(), bias)
    for i in range(20):
        assert torch.equal(f(x[i:i + 1], bias), y[i:i + 1])
    assert half_linear(weight + 1e-6) is None  # one rounding away from fp16: refused
    assert half_linear(weight.double()) is None and half_linear(weight[0]) is None


def test_compact_linear_finds_exact_int8_blocks_like_q8_0():
    gen = torch.Generator().manual_seed(5)
    n, k = 64, 100  # k: three full blocks of 32 and a short one
    codes = torch.randint(-127, 128, (n, k), generator=gen)
    codes[:, ::32] = 127  # every block reaches the largest code, as Q8_0's quantizer does
    scale = (torch.rand(n, 4, generator=gen) * 0.01).half().float()
    weight = codes.float() * scale.repeat_interleave(32, dim=1)[:, :k]
    f = compact_linear(weight)
    assert f is not None and f.name == "int8-block32"
    assert f.nbytes < weight.nbytes / 3
    x = torch.randn(17, k, generator=gen)
    y = f(x)
    assert_close_to_exact(y, x, weight.t())
    for i in range(17):
        assert torch.equal(f(x[i:i + 1]), y[i:i + 1])
    halfable = (torch.randn(n, k, generator=gen) * 0.05).half().float()
    assert compact_linear(halfable).name == "fp16"
    assert compact_linear(torch.randn(n, k, generator=gen)) is None  # plain fp32: nothing exact
    bad = weight.clone()
    bad[3, 5] += scale[3, 0] * 0.5  # half a step off the grid: not int8 x scale any more
    assert compact_linear(bad) is None or compact_linear(bad).name == "fp16"


def test_plain_linear_is_batch_invariant_where_mkl_is_not():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(1000, 96, generator=gen)  # nothing smaller is exact: fp32 tiles
    bias = torch.randn(1000, generator=gen)
    f = plain_linear(weight)
    assert f.name == "fp32"
    x = torch.randn(16, 96, generator=gen)
    y = f(x, bias)
    assert_close_to_exact(y, x, weight.t(), bias)
    assert all(torch.equal(f(x[i:i + 1], bias), y[i:i + 1]) for i in range(16))
    assert plain_linear(weight.half().float()).name == "fp16"
    assert plain_linear(weight.double()) is None


def test_registry_picks_the_cpu_kernel_for_fp32_on_cpu(monkeypatch):
    monkeypatch.delenv(registry.ENV_KERNEL, raising=False)
    assert "cpu" in registry.kernel_names()
    w = random_gptq(64, 32, 4, 32, True)
    kernel = registry.select(w, torch.device("cpu"), torch.float32)
    assert kernel.name == "cpu"
    assert isinstance(registry.select(w, torch.device("cpu"), torch.bfloat16), DenseKernel)
    monkeypatch.setenv(registry.ENV_KERNEL, "dense")
    assert isinstance(registry.select(w, torch.device("cpu"), torch.float32), DenseKernel)
    monkeypatch.setenv(registry.ENV_KERNEL, "cpu")
    assert registry.select(w, torch.device("cpu"), torch.float32).name == "cpu"


def test_quant_linear_runs_on_the_cpu_kernel(monkeypatch):
    from flotilla.models.config import QuantConfig
    from flotilla.models.linear import QuantLinear

    monkeypatch.delenv(registry.ENV_KERNEL, raising=False)
    parts = [random_gptq(96, n, 4, 32, False, seed=s) for s, n in ((0, 64), (1, 32))]
    lin = QuantLinear(96, [64, 32], bias=True, quant=QuantConfig(bits=4, group_size=32, sym=False))
    for shard, w in enumerate(parts):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            lin.load(suffix, shard, getattr(w, suffix))
    lin.bias.copy_(torch.randn(96))
    lin.prepare(torch.float32)
    assert lin.kernel.name == "cpu" and "kernel=cpu" in repr(lin)
    x = torch.randn(7, 96)
    dense = torch.cat([dequantize(w, torch.float64) for w in parts], dim=1)
    assert_close_to_exact(lin(x), x, dense, lin.bias)


def test_bad_inputs_raise_clear_errors():
    kernel = cpu_gptq_kernel(random_gptq(64, 32, 4, 32, True))
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 64).double())
    with pytest.raises(RuntimeError, match="expected 64"):
        kernel(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.randn(2, 64), torch.randn(31))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    full.pop(registry.ENV_KERNEL, None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


SELECT = ("import torch; from flotilla.kernels import registry; from flotilla.kernels.gptq import GPTQWeight, "
          "default_g_idx; g = default_g_idx(64, -1); "
          "w = GPTQWeight.from_codes(torch.zeros(64, 8, dtype=torch.int32), torch.ones(1, 8, dtype=torch.int32), "
          "torch.ones(1, 8).half(), g, 4, -1); "
          "print(type(registry.select(w, torch.device('cpu'), torch.float32)).__name__); "
          "print(type(registry.select(w, torch.device('cpu'), torch.float32)).__name__)")


def test_without_a_compiler_falls_back_to_dense_with_one_warning(tmp_path):
    out = _run(SELECT, CXX=str(tmp_path / "no-such-c++"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DenseKernel", "DenseKernel"]
    warnings = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "dense kernel" in warnings[0]


def test_a_cached_build_loads_without_compiling():
    build.load()  # built (or found) by this process already
    out = _run(SELECT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PackedLinear", "PackedLinear"]
    assert "compiling" not in out.stderr


def test_two_installs_of_the_same_sources_get_their_own_builds(tmp_path, monkeypatch):
    """torch's ninja file names the source paths: sharing a build, two installs (worktrees, venvs)
    would rebuild it for each other on every start."""
    import shutil

    name = build.build_name("avx2")
    assert build.build_name("avx2") == name  # stable
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    assert build.build_name("avx2") != name
