"""The GPTQ reference kernel against tensors packed by hand from the format description."""
from __future__ import annotations

import pytest
import torch

from flotilla.kernels.gptq import GPTQWeight, pack_cols, pack_rows, unpack_cols, unpack_rows
from flotilla.kernels.reference import DenseKernel, dequantize, gptq_matmul


def hand_pack_rows(q: list[list[int]], bits: int) -> torch.Tensor:
    """Pack [in][out] codes along the input axis, LSB first, with plain integer arithmetic."""
    per_word = 32 // bits
    rows, cols = len(q), len(q[0])
    out = []
    for r in range(rows // per_word):
        row = []
        for c in range(cols):
            word = 0
            for j in range(per_word):
                word |= q[r * per_word + j][c] << (bits * j)
            row.append(word - (1 << 32) if word >= 1 << 31 else word)
        out.append(row)
    return torch.tensor(out, dtype=torch.int32)


def hand_pack_cols(z: list[list[int]], bits: int) -> torch.Tensor:
    per_word = 32 // bits
    out = []
    for row in z:
        packed = []
        for c in range(len(row) // per_word):
            word = 0
            for j in range(per_word):
                word |= row[c * per_word + j] << (bits * j)
            packed.append(word - (1 << 32) if word >= 1 << 31 else word)
        out.append(packed)
    return torch.tensor(out, dtype=torch.int32)


def test_hand_worked_4bit_word():
    # Eight 4-bit codes 1..8 in one column: LSB first gives 0x87654321.
    q = [[v] * 8 for v in range(1, 9)]
    packed = hand_pack_rows(q, 4)
    assert packed.shape == (1, 8)
    assert packed[0, 0].item() == 0x87654321 - (1 << 32)
    assert torch.equal(pack_rows(torch.tensor(q), 4), packed)
    assert torch.equal(unpack_rows(packed, 4), torch.tensor(q, dtype=torch.int32))


def test_hand_worked_8bit_word_and_zeros():
    q = [[0x11], [0x22], [0x33], [0xF4]]
    assert hand_pack_rows(q, 8)[0, 0].item() == 0xF4332211 - (1 << 32)
    z = [[1, 2, 3, 255]]
    assert torch.equal(pack_cols(torch.tensor(z), 8), hand_pack_cols(z, 8))
    assert torch.equal(unpack_cols(hand_pack_cols(z, 8), 8), torch.tensor(z, dtype=torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [8, 16, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_matches_formula(bits, group_size, act_order):
    g = torch.Generator().manual_seed(bits * 100 + group_size + act_order)
    in_f, out_f = 32, 16
    maxq = (1 << bits) - 1
    groups = 1 if group_size == -1 else in_f // group_size
    q = torch.randint(0, maxq + 1, (in_f, out_f), generator=g)
    zeros = torch.randint(1, maxq + 1, (groups, out_f), generator=g)  # stored as zero - 1
    scales = (torch.rand(groups, out_f, generator=g) * 0.1 + 0.01).half()
    g_idx = torch.arange(in_f) // (in_f if group_size == -1 else group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=g)]
    w = GPTQWeight(hand_pack_rows(q.tolist(), bits), hand_pack_cols((zeros - 1).tolist(), bits), scales,
                   g_idx.int(), bits, group_size)
    expected = torch.empty(in_f, out_f)
    for i in range(in_f):
        for o in range(out_f):
            gi = int(g_idx[i])
            expected[i, o] = float(scales[gi, o]) * (int(q[i, o]) - int(zeros[gi, o]))
    assert torch.equal(dequantize(w), expected)
    x = torch.randn(3, in_f, generator=g)
    bias = torch.randn(out_f, generator=g)
    torch.testing.assert_close(gptq_matmul(x, w, bias), x @ expected + bias)
    torch.testing.assert_close(DenseKernel(w, torch.float32)(x, bias), x @ expected + bias)


def test_from_codes_round_trip_and_zero_range():
    q = torch.randint(0, 16, (64, 8))
    zeros = torch.randint(1, 16, (2, 8))
    scales = torch.rand(2, 8).half()
    g_idx = torch.arange(64) // 32
    w = GPTQWeight.from_codes(q, zeros, scales, g_idx, 4, 32)
    assert torch.equal(w.codes(), q.int()) and torch.equal(w.zeros(), zeros.int())
    assert not w.has_act_order
    with pytest.raises(ValueError, match="zero points"):
        GPTQWeight.from_codes(q, zeros * 0, scales, g_idx, 4, 32)
    with pytest.raises(ValueError, match="bit width"):
        pack_rows(q, 3)
