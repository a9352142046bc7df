"""GGUF block types decoded into flotilla's form: exact against gguf.quants.dequantize."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight, decode

from ggml_helpers import random_blocks


@pytest.mark.parametrize("qtype", sorted(GGML_FORMATS))
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    import gguf

    fmt = GGML_FORMATS[qtype]
    rows, cols = 6, 2 * 256
    raw = random_blocks(qtype, rows, cols)
    w = decode(raw, qtype, rows, cols)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))
    assert ref.shape == (rows, cols)
    got = w.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert w.codes.dtype == torch.int8 and w.scales.shape == (rows, cols // fmt.group)
    assert int(w.codes.min()) >= fmt.code_min and int(w.codes.max()) <= fmt.code_max
    assert (w.mins is not None) == fmt.has_min
    if fmt.fp16_scales:  # what the kernels store in half precision must be exact there
        assert torch.equal(w.scales.half().float(), w.scales)
        assert w.mins is None or torch.equal(w.mins.half().float(), w.mins)


def test_gguf_quantizer_output_round_trips():
    """Blocks made by gguf's own quantizer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), not only random bytes."""
    import gguf

    x = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        qt = gguf.GGMLQuantizationType[qtype]
        raw = gguf.quants.quantize(x, qt)
        got = decode(raw, qtype, 8, 128).dequantize()
        assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, qt)))


def test_rows_cuts_and_stacking_keep_the_values():
    raw = random_blocks("Q4_K", 8, 512, seed=2)
    w = decode(raw, "Q4_K", 8, 512)
    dense = w.dequantize()
    perm = torch.tensor([3, 1, 7, 0])
    assert torch.equal(w.take_rows(perm).dequantize(), dense[perm])
    assert torch.equal(w.dequantize_rows(perm), dense[perm])
    assert torch.equal(w.narrow(0, 2, 3).dequantize(), dense[2:5])
    assert torch.equal(w.narrow(1, 64, 96).dequantize(), dense[:, 64:160])
    with pytest.raises(ValueError, match="group of 32"):
        w.narrow(1, 16, 32)
    both = GGMLWeight.cat([w.narrow(0, 0, 2), w.narrow(0, 5, 3)])
    assert torch.equal(both.dequantize(), torch.cat([dense[:2], dense[5:]]))
    with pytest.raises(ValueError, match="different types"):
        GGMLWeight.cat([w, decode(random_blocks("Q8_0", 8, 512), "Q8_0", 8, 512)])
    with pytest.raises(ValueError, match="whole blocks"):
        decode(random_blocks("Q4_K", 8, 512)[:, :72], "Q4_K", 8, 128)
