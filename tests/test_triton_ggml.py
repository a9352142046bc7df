"""The Triton kernels for GGUF forms against the exact dequantized weights, on CPU tensors through
TRITON_INTERPRET=1 (CI has no GPU; bench/kernels.py --gguf times them on one)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from flotilla.kernels.ggml import GGMLWeight  # noqa: E402
from flotilla.kernels.triton_ggml import TRITON_FORMS, TritonGGMLKernel, triton_ggml_kernel  # noqa: E402

from ggml_helpers import random_weight  # noqa: E402
from test_triton_kernels import _patch_interpreter  # noqa: E402

_patch_interpreter()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("qtype", TRITON_FORMS)
def test_each_form_matches_the_exact_weights(qtype):
    w = random_weight(qtype, 80, 256, seed=2, scale=0.01)  # 80 outputs: a partial 64-column tile
    kernel = TritonGGMLKernel([w], torch.device("cpu"), torch.float16)
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(80, generator=gen).half()
    for m in (1, 5, 40):  # split-K decode tiles, and one wider tile
        x = torch.randn(m, 256, generator=gen).half()
        y = kernel(x, bias)
        ref = x.float() @ dense.t() + bias.float()
        assert y.shape == (m, 80) and y.dtype == torch.float16
        assert rel_err(y, ref) < 2e-3, (qtype, m)
    ids = torch.tensor([79, 0, 41])
    assert torch.equal(kernel.rows(ids), dense[ids].half())


def test_mixed_parts_and_bf16():
    parts = [random_weight("Q4_K", 64, 256, 1, 0.01), random_weight("Q4_K", 32, 256, 2, 0.01),
             random_weight("Q6_K", 32, 256, 3, 0.01), torch.randn(16, 256) * 0.02]
    kernel = TritonGGMLKernel(parts, torch.device("cpu"), torch.bfloat16)
    assert len(kernel.runs) == 3 and kernel.part_forms[2].startswith("triton int8")
    x = torch.randn(3, 2, 256).bfloat16()
    dense = torch.cat([p.dequantize() if isinstance(p, GGMLWeight) else p for p in parts])
    y = kernel(x)
    assert y.shape == (3, 2, 144)
    assert rel_err(y, x.float() @ dense.t()) < 1.5e-2


def test_only_cuda_and_16_bit_activations_get_the_kernel():
    w = random_weight("Q4_0", 32, 64)
    assert triton_ggml_kernel([w], torch.device("cpu"), torch.float16) is None
    assert triton_ggml_kernel([w], torch.device("cuda"), torch.float32) is None
