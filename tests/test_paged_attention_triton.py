"""The engine's attention entry point dispatching decodes to the Triton kernel, checked on CPU
tensors through TRITON_INTERPRET=1 against the torch path of the same function."""
from __future__ import annotations

import pytest

from conftest import interpreter_only

interpreter_only()  # conftest switched the interpreter on where no GPU is visible
import torch  # noqa: E402

pytest.importorskip("triton")

import test_triton_kernels  # noqa: E402,F401  (patches two Triton 3.6 interpreter bugs on import)
from flotilla.kernels.attention import _TritonDecode, paged_attention, store_kv  # noqa: E402

from test_paged_attention import build  # noqa: E402


@pytest.mark.parametrize("sms", [1, 64])  # one split, or split-K over the context
def test_decodes_through_triton_match_the_torch_path(sms):
    seqs = [(9, 1), (0, 1), (1100, 1), (40, 1)]
    kc, vc, _, _, q, k, v, meta = build(seqs, num_blocks=400)
    store_kv(kc, vc, k, v, meta)
    want = paged_attention(q, kc, vc, meta, scale=0.25)  # CPU tensors: the torch path
    triton_decode = _TritonDecode.for_step(meta, sms=sms)
    assert triton_decode.num_splits == (1 if sms == 1 else 2)  # the longest context (1101) over 512
    got = triton_decode(q, kc, vc, 0.25)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("window", [1, 5, 700])
@pytest.mark.parametrize("sms", [1, 64])
def test_a_sliding_window_through_triton_matches_the_torch_path(sms, window):
    """The kernel starts each sequence at seq_len - window (split-K over what is left); sequences shorter than
    the window read all of theirs."""
    seqs = [(9, 1), (0, 1), (1100, 1), (40, 1)]
    kc, vc, _, _, q, k, v, meta = build(seqs, num_blocks=400)
    store_kv(kc, vc, k, v, meta)
    want = paged_attention(q, kc, vc, meta, scale=0.25, window=window)  # CPU tensors: the torch path
    got = _TritonDecode.for_step(meta, sms=sms)(q, kc, vc, 0.25, window)
    assert (got - want).abs().max().item() < 1e-4
    # split by what a sequence reads: the window, where it is shorter than the longest context (1101)
    split = _TritonDecode.for_step(meta, sms=sms, window=window)
    assert split.num_splits == (1 if sms == 1 or window < 1024 else 2)
    assert (split(q, kc, vc, 0.25, window) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("sms", [1, 64])
def test_soft_capped_scores_through_triton_match_the_torch_path(sms):
    seqs = [(9, 1), (0, 1), (1100, 1), (40, 1)]
    kc, vc, _, _, q, k, v, meta = build(seqs, num_blocks=400)
    q = q * 4
    store_kv(kc, vc, k, v, meta)
    want = paged_attention(q, kc, vc, meta, scale=0.25, window=300, softcap=2.0)  # CPU tensors: the torch path
    got = _TritonDecode.for_step(meta, sms=sms)(q, kc, vc, 0.25, 300, 2.0)
    assert (got - want).abs().max().item() < 1e-4
