"""The compiled CPU kernels on GGUF forms against the exact dequantized weights, both ISAs."""
from __future__ import annotations

import pytest
import torch

from flotilla.kernels.cpu import build
from flotilla.kernels.cpu.ggml_pack import cpu_ggml_kernel, pack_ggml
from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight

from ggml_helpers import random_weight

pytestmark = pytest.mark.skipif(build.load() is None, reason="the CPU kernels cannot be compiled here")


def magnitude(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """sum_k |x_k| (|scale * code| + |min|): what the kernel's fp32 terms add up to, so the scale of
    its rounding error (with mins, scale * sum(x q) and min * sum(x) may cancel)."""
    g = w.format.group
    size = (w.codes.float().abs().view(w.out_features, -1, g) * w.scales.abs().unsqueeze(-1))
    if w.mins is not None:
        size = size + w.mins.abs().unsqueeze(-1)
    return x.double().abs() @ size.view(w.shape).double().t()


def assert_close(y: torch.Tensor, x: torch.Tensor, w: GGMLWeight, bias=None) -> None:
    exact = x.double() @ w.dequantize().double().t()
    if bias is not None:
        exact = exact + bias.double()
    err = (y.double() - exact).abs()
    bound = 1e-5 * magnitude(x, w) + 1e-6
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("qtype", sorted(GGML_FORMATS))
def test_each_type_matches_the_exact_weights_and_is_batch_invariant(qtype):
    w = random_weight(qtype, 72, 512, seed=7)  # 72 outputs: two tiles and a partial one
    kernel = cpu_ggml_kernel([w])
    assert kernel.name == f"cpu {kernel.part_forms[0].split(' (')[0][4:]}"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, 512, generator=gen)
    bias = torch.randn(72, generator=gen)
    y = kernel(x, bias)
    assert_close(y, x, w, bias)
    for m in (1, 2, 6, 7):
        assert torch.equal(kernel(x[:m], bias), y[:m])
    assert torch.equal(kernel(x[5:6], bias), y[5:6])
    ids = torch.tensor([71, 0, 33, 33])  # the embedding lookup: exactly the dequantized rows
    assert torch.equal(kernel.rows(ids), w.dequantize()[ids])


def test_avx2_and_avx512_give_the_same_bits():
    if build.cpu_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512: only one build to test")
    avx2, avx512 = build.load("avx2"), build.load("avx512")
    x = torch.randn(9, 512)
    for qtype in sorted(GGML_FORMATS):
        packed = pack_ggml(random_weight(qtype, 40, 512, seed=3, scale=0.01))
        for m in (1, 9):
            assert torch.equal(packed.build(avx2)(x[:m]), packed.build(avx512)(x[:m])), qtype


def test_merged_parts_of_different_types_run_as_one_linear():
    """q/k/v of a Q4_K_M file: two parts of one type share a packing, the others run beside it."""
    parts = [random_weight("Q4_K", 64, 256, 1, 0.01), random_weight("Q4_K", 32, 256, 2, 0.01),
             random_weight("Q6_K", 32, 256, 3, 0.01), random_weight("Q8_0", 40, 256, 4, 0.01),
             torch.randn(24, 256) * 0.02]
    kernel = cpu_ggml_kernel(parts)
    assert len(kernel.part_forms) == 5 and "int8" in kernel.part_forms[2] and "fp32" in kernel.part_forms[4]
    x = torch.randn(11, 256)
    bias = torch.randn(192)
    dense = torch.cat([p.dequantize() if isinstance(p, GGMLWeight) else p for p in parts])
    y = kernel(x, bias)
    exact = x.double() @ dense.double().t() + bias.double()
    assert float((y.double() - exact).abs().max()) < 1e-4 * float(exact.abs().max())
    alone = torch.cat([cpu_ggml_kernel([p])(x) for p in parts], dim=1) + bias
    assert torch.allclose(y, alone, rtol=0, atol=1e-5)  # the same per-part arithmetic (bias added once)
    assert all(torch.equal(kernel(x[i:i + 1], bias), y[i:i + 1]) for i in range(11))


FORCED = """
import sys, torch
from flotilla.kernels.cpu import build
from flotilla.models.sources import GGUFSource
from flotilla.models.weights import load_stage
from test_models import our_logits
model = load_stage(GGUFSource(sys.argv[1]))
ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(7))
from safetensors.torch import save_file
save_file({"logits": our_logits(model, ids).contiguous()}, sys.argv[2])
print(build.load().isa())
"""


def test_forced_avx2_build_runs_a_model_to_the_same_bits(tmp_path):
    """FLOTILLA_CPU_ISA=avx2 on an AVX-512 CPU: the whole GGUF model on the AVX2 build, bit for bit
    the AVX-512 one (how CI tests both builds)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from conftest import REPO
    from ggml_helpers import mixed_gguf

    if build.cpu_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512: only one build to test")
    path = mixed_gguf(tmp_path, tied=True)
    out = {}
    for isa in ("avx2", "avx512"):
        env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", FLOTILLA_CPU_ISA=isa)
        proc = subprocess.run([sys.executable, "-c", FORCED, str(path), str(tmp_path / f"{isa}.st")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[-1] == isa
        out[isa] = load_file(tmp_path / f"{isa}.st")["logits"]
    assert torch.equal(out["avx2"], out["avx512"])


def test_decode_rows_of_tiny_activations_give_the_same_bits():
    """A decode row (M = 1) of the AVX2 build reads its codes against activations prescaled by
    powers of two where that is exact; rows too small for it (below 2**-102, subnormal) take the
    plain path. The same bits either way: alone or batched, in both builds."""
    builds = [build.load("avx2")] + ([build.load("avx512")] if build.cpu_isa() == "avx512" else [])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 512, generator=gen)
    x[1] *= 1e-32  # all tiny
    x[2] *= 1e-40  # subnormal
    x[3, 77] = 1e-36  # one tiny input among normal ones
    for qtype in ("Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"):
        packed = pack_ggml(random_weight(qtype, 40, 512, seed=5, scale=0.01))
        want = packed.build(builds[0])(x)
        assert bool((want[1:3] != 0).any()), qtype
        for ext in builds:
            kernel = packed.build(ext)
            assert torch.equal(kernel(x), want), qtype
            for i in range(4):
                assert torch.equal(kernel(x[i:i + 1]), want[i:i + 1]), (qtype, i)
