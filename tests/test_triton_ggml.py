"""The GGUF forms in the Triton layout against the exact dequantized weights, on CPU tensors through
TRITON_INTERPRET=1 (CI has no GPU; bench/kernels.py --gguf checks and times them on one)."""
from __future__ import annotations

import pytest

from conftest import interpreter_only

interpreter_only()  # conftest switched the interpreter on where no GPU is visible
import torch  # noqa: E402

pytest.importorskip("triton")

from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight  # noqa: E402
from flotilla.kernels.triton_gemm import pair_asm  # noqa: E402
from flotilla.kernels.triton_ggml import (TRITON_FORMS, TritonGGMLKernel, layout_rows, repack_ggml,  # noqa: E402
                                          triton_ggml_kernel)
from flotilla.kernels.triton_layout import unpack_layout  # noqa: E402
from flotilla.kernels.triton_linear import GemmConfig, dequantize_layout  # noqa: E402

from ggml_helpers import random_weight  # noqa: E402
from test_triton_kernels import _patch_interpreter, _silu_ref  # noqa: E402

_patch_interpreter()

CPU = torch.device("cpu")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def exact_in_fp16(qtype: str) -> bool:
    """Forms whose scales and offsets are fp16 values: the layout holds them exactly in fp16."""
    return GGML_FORMATS[qtype].fp16_scales


@pytest.mark.parametrize("qtype", TRITON_FORMS)
def test_each_form_matches_the_exact_weights(qtype):
    w = random_weight(qtype, 80, 256, seed=2, scale=0.01)  # 80 outputs: a partial 64-column tile
    kernel = TritonGGMLKernel([w], CPU, torch.float16)
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(80, generator=gen).half()
    for m in (1, 5, 40, 64):  # split-K decode tiles, and the 256-wide split tiles of 17-64 rows
        x = torch.randn(m, 256, generator=gen).half()
        y = kernel(x, bias)
        ref = x.float() @ dense.t() + bias.float()
        assert y.shape == (m, 80) and y.dtype == torch.float16
        assert rel_err(y, ref) < 2e-3, (qtype, m)
    ids = torch.tensor([79, 0, 41])
    rows = kernel.rows(ids)
    # contiguous: the step's fused norm (kernels/fused) takes the embedded rows only so; strided rows went to torch
    assert rows.shape == (3, 256) and rows.is_contiguous()
    assert layout_rows(kernel.runs[0][2].layout, ids, torch.float32).is_contiguous()  # no cast: still contiguous
    if exact_in_fp16(qtype):
        assert torch.equal(rows, dense[ids].half())
    else:  # d * sc and dmin * m rounded to fp16
        assert rel_err(rows, dense[ids]) < 1e-3


@pytest.mark.parametrize("qtype", TRITON_FORMS)
def test_layout_holds_the_codes_and_reads_back_the_weight(qtype):
    """The repacked codes are the form's codes less code_min; the weight read back through the
    kernel (identity activations, scale on the weight side) and through the dense path is the
    reference dequantization bit for bit where the tables are fp16 values."""
    fmt = GGML_FORMATS[qtype]
    w = random_weight(qtype, 48, 256, seed=3, scale=0.01)
    layout = repack_ggml(w, torch.float16, CPU)
    assert torch.equal(unpack_layout(layout), (w.codes.t().to(torch.int32) - fmt.code_min))
    assert layout.group_size == fmt.group and (layout.offsets is not None) == fmt.has_min
    kernel = TritonGGMLKernel([w], CPU, torch.float16)
    read = kernel.runs[0][2](torch.eye(256).half(), config=GemmConfig("dot", 64, 32, 2, scale_w=True)).t()
    dense = dequantize_layout(layout, torch.float16)  # [out, in]
    want = w.dequantize(torch.float16)
    if exact_in_fp16(qtype):
        assert torch.equal(read, want) and torch.equal(dense, want)
    else:
        assert rel_err(read, want) < 1e-3 and torch.equal(dense, read)
    for n0, n1 in ((0, 20), (13, 48), (37, 41)):  # column chunks (the overlapped dense path), unaligned too
        assert torch.equal(dequantize_layout(layout, torch.float16, n0=n0, n1=n1), dense[n0:n1])


def test_mixed_parts_bias_and_bf16():
    parts = [random_weight("Q4_K", 64, 256, 1, 0.01), random_weight("Q4_K", 32, 256, 2, 0.01),
             random_weight("Q6_K", 32, 256, 3, 0.01), torch.randn(16, 256) * 0.02, random_weight("Q4_1", 32, 256, 4, 0.01)]
    kernel = TritonGGMLKernel(parts, CPU, torch.bfloat16)
    assert len(kernel.runs) == 4
    assert kernel.part_forms[0] == "triton 4-bit x bfloat16 scale + min per 32"
    assert kernel.part_forms[2] == "triton 8-bit x bfloat16 scale per 16"
    x = torch.randn(3, 2, 256).bfloat16()
    bias = torch.randn(176).bfloat16()
    dense = torch.cat([p.dequantize() if isinstance(p, GGMLWeight) else p for p in parts])
    y = kernel(x, bias)
    assert y.shape == (3, 2, 176)
    assert rel_err(y, x.float() @ dense.t() + bias.float()) < 1.5e-2


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])  # a float offset at 4 bits; an integer zero at 8
def test_gate_up_of_one_form_runs_the_silu_epilogue(qtype):
    """silu(gate) * up of a GGUF [gate | up] linear: one launch (the Triton tiles' epilogue) where both
    halves are one form, the product then kernels/fused.silu_mul where the parts are runs of two forms:
    either way what silu_mul of the product gives; GGUFLinear hands the model that callable."""
    from flotilla.models.gguf_linear import GGUFLinear

    gate, up = random_weight(qtype, 64, 256, 1, 0.01), random_weight(qtype, 64, 256, 2, 0.01)
    x = torch.randn(3, 2, 256, generator=torch.Generator().manual_seed(3)).half()
    one = TritonGGMLKernel([gate, up], CPU, torch.float16)
    op = one.runs[0][2]
    assert len(one.runs) == 1 and op.fuses_silu(6)
    calls = []
    real = op.silu_mul
    op.silu_mul = lambda *a, **k: calls.append(1) or real(*a, **k)
    y = one.silu_mul(x)
    assert calls and y.shape == (3, 2, 64)
    torch.testing.assert_close(y, _silu_ref(one(x).view(6, 128)).view(3, 2, 64), rtol=2e-3, atol=1e-4)
    up6 = random_weight("Q6_K", 64, 256, 2, 0.01)
    mixed = TritonGGMLKernel([gate, up6], CPU, torch.float16)
    assert len(mixed.runs) == 2
    g, u = x.float() @ gate.dequantize().t(), x.float() @ up6.dequantize().t()  # the exact weights, in fp32
    assert rel_err(mixed.silu_mul(x), torch.nn.functional.silu(g) * u) < 5e-3
    lin = GGUFLinear(256, [64, 64], bias=False)
    lin.kernel = one
    assert lin.silu_mul_fn()(x).shape == (3, 2, 64)


def test_offset_decode_is_the_scale_decode_with_one_fused_multiply_add():
    """The PTX of the offset forms: the same decode as GPTQ's weight-side scale, its multiply
    replaced by one fma with the packed offset ($5); GPTQ's strings are unchanged."""
    for bits, bf16, odd in ((4, False, False), (4, False, True), (8, False, False), (4, True, False)):
        plain = pair_asm(bits, bf16, True, odd)
        kind = "bf16x2" if bf16 else "f16x2"
        assert pair_asm(bits, bf16, True, odd, offset=True) == plain.replace(
            f"mul.rn.{kind} p, p, $4; ", f"fma.rn.{kind} p, p, $4, $5; ")
        assert "$5" not in plain


def test_only_cuda_and_16_bit_activations_get_the_kernel():
    w = random_weight("Q4_0", 32, 64)
    assert triton_ggml_kernel([w], CPU, torch.float16) is None
    assert triton_ggml_kernel([w], torch.device("cuda"), torch.float32) is None
