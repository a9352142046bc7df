"""Tensor-parallel sharding without any process group: each rank's share of every layer, loaded
from the whole checkpoint tensors, against the slice of the unsharded (dequantized) weight; the
sum of the row-parallel ranks' partial products against the whole product; and the errors for
sizes that do not divide."""
from __future__ import annotations

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight, default_g_idx, num_groups
from flotilla.kernels.reference import dequantize
from flotilla.models.config import ModelConfig, QuantConfig
from flotilla.models.linear import Linear, LMHead, QuantLinear, make_embedding, make_linear, make_lm_head
from flotilla.models.parallel import (ColumnParallelQuantLinear, ParallelLMHead, RowParallelQuantLinear,
                                      VocabParallelEmbedding)
from flotilla.models.parallel_state import TPGroup, check_divisible, tensor_parallel

from conftest import tiny_config


def random_gptq(n_in: int, n_out: int, bits: int = 4, group_size: int = 32, act_order: bool = False,
                seed: int = 0) -> GPTQWeight:
    """Random codes, asymmetric zeros and scales; with act_order a g_idx that spreads every group's
    rows over the whole input axis (as GPTQ's act-order leaves it)."""
    g = torch.Generator().manual_seed(seed)
    groups = num_groups(n_in, group_size)
    q = torch.randint(0, 2 ** bits, (n_in, n_out), generator=g, dtype=torch.int32)
    zeros = torch.randint(1, 2 ** bits, (groups, n_out), generator=g, dtype=torch.int32)
    scales = torch.rand(groups, n_out, generator=g) * 0.02 + 0.001
    g_idx = default_g_idx(n_in, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(n_in, generator=g)]
    return GPTQWeight.from_codes(q, zeros, scales, g_idx, bits, group_size)


def load_gptq(lin, shard: int, w: GPTQWeight, bias: torch.Tensor | None = None) -> None:
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        lin.load(suffix, shard, getattr(w, suffix))
    if bias is not None:
        lin.load("bias", shard, bias)


def quant(bits=4, group_size=32, desc_act=False) -> QuantConfig:
    return QuantConfig(bits=bits, group_size=group_size, desc_act=desc_act)


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_gptq_holds_each_projections_output_slice(world):
    n_in, sizes = 128, [64, 32, 32]  # q, k, v of a merged qkv_proj
    ws = [random_gptq(n_in, n, seed=i, act_order=True) for i, n in enumerate(sizes)]
    ws = [GPTQWeight(w.qweight, w.qzeros, w.scales, ws[0].g_idx, 4, 32) for w in ws]  # one act-order for all
    biases = [torch.randn(n) for n in sizes]
    full = [dequantize(w) for w in ws]  # [in, out] each
    for rank in range(world):
        with tensor_parallel(TPGroup(rank, world)):
            lin = make_linear(n_in, sizes, True, quant(), split="column")
        assert isinstance(lin, ColumnParallelQuantLinear) and lin.out_sizes == [n // world for n in sizes]
        for shard, (w, b) in enumerate(zip(ws, biases)):
            load_gptq(lin, shard, w, b)
        cols = [slice(rank * n // world, (rank + 1) * n // world) for n in sizes]
        expected = torch.cat([f[:, c] for f, c in zip(full, cols)], dim=1)
        assert torch.equal(dequantize(lin.gptq_weight()), expected)
        assert torch.equal(lin.bias, torch.cat([b[c] for b, c in zip(biases, cols)]))
        assert torch.equal(lin.g_idx, ws[0].g_idx)  # the input axis is whole


@pytest.mark.parametrize("case, n_in, group_size, world, act_order", [
    ("groups on rank boundaries", 256, 32, 2, False),
    ("groups straddle ranks", 192, 64, 4, False),  # 48 rows a rank, groups of 64
    ("act-order", 256, 32, 2, True),
    ("act-order, one group", 128, -1, 4, True),
    ("partial last group", 320, 128, 5, False),  # 64 rows a rank; the last rank's group is the short one
    ("partial last group, act-order", 320, 128, 2, True),
])
def test_row_parallel_gptq_holds_its_input_rows(case, n_in, group_size, world, act_order):
    n_out = 64
    w = random_gptq(n_in, n_out, group_size=group_size, act_order=act_order, seed=7)
    bias = torch.randn(n_out)
    full = dequantize(w)
    x = torch.randn(5, n_in)
    partial_sum = torch.zeros(5, n_out)
    for rank in range(world):
        group = TPGroup(rank, world)
        with tensor_parallel(group):
            lin = make_linear(n_in, [n_out], True, quant(group_size=group_size), split="row")
        assert isinstance(lin, RowParallelQuantLinear) and lin.in_features == n_in // world
        load_gptq(lin, 0, w, bias)
        rows = group.part(n_in)
        assert torch.equal(dequantize(lin.gptq_weight()), full[rows])
        used = torch.unique(w.g_idx[rows])
        assert lin.scales.shape[0] == int(used.max()) - int(used.min()) + 1  # only the groups its rows use
        if case == "groups on rank boundaries":  # exactly its own groups, g_idx the plain i // group_size
            assert lin.scales.shape[0] == n_in // world // group_size and not lin.gptq_weight().has_act_order
        lin.prepare(torch.float32)  # the registry's kernel for this device, reading the local g_idx
        partial_sum += lin.kernel(x[:, rows], lin.bias if group.is_first else None)
    torch.testing.assert_close(partial_sum, x @ full + bias, rtol=1e-5, atol=1e-5)


def test_row_parallel_gptq_without_g_idx_in_the_file():
    w = random_gptq(256, 32, group_size=32)
    for rank in range(2):
        with tensor_parallel(TPGroup(rank, 2)):
            lin = make_linear(256, [32], False, quant(), split="row")
        for suffix in ("qweight", "qzeros", "scales"):
            lin.load(suffix, 0, getattr(w, suffix))
        lin.load("g_idx", 0, lin.missing_g_idx())  # what the loader does when the file has no g_idx
        assert torch.equal(dequantize(lin.gptq_weight()), dequantize(w)[rank * 128:(rank + 1) * 128])


def test_plain_linears_embedding_and_head_hold_their_slices():
    torch.manual_seed(0)
    qkv = [torch.randn(n, 16) for n in (8, 4, 4)]
    o, emb = torch.randn(16, 8), torch.randn(12, 16)
    for rank in range(2):
        group = TPGroup(rank, 2)
        with tensor_parallel(group):
            col = make_linear(16, [8, 4, 4], False, None, split="column")
            row = make_linear(8, [16], True, None, split="row")
            embed, head = make_embedding(12, 16), make_lm_head(16, 12)
        for shard, t in enumerate(qkv):
            col.load("weight", shard, t)
        row.load("weight", 0, o)
        embed.load("weight", 0, emb)
        head.load("weight", 0, emb)
        half = lambda n: slice(rank * n // 2, (rank + 1) * n // 2)  # noqa: E731
        assert torch.equal(col.weight, torch.cat([t[half(t.shape[0])] for t in qkv]))
        assert torch.equal(row.weight, o[:, half(8)])
        assert isinstance(embed, VocabParallelEmbedding) and torch.equal(embed.weight, emb[half(12)])
        assert isinstance(head, ParallelLMHead) and torch.equal(head.weight, emb[half(12)])


def test_without_a_group_the_factories_build_single_device_layers():
    for group in (None, TPGroup(0, 1)):
        with tensor_parallel(group):
            assert type(make_linear(64, [32, 32], False, None, split="column")) is Linear
            assert type(make_linear(64, [32], False, quant(), split="row")) is QuantLinear
            assert type(make_embedding(10, 4)) is torch.nn.Embedding
            assert type(make_lm_head(4, 10)) is LMHead


def test_a_whole_checkpoint_tensor_is_required():
    with tensor_parallel(TPGroup(0, 2)):
        lin = make_linear(16, [8], False, None, split="column")
    with pytest.raises(FlotillaError, match=r"expected 8 along axis 0"):
        lin.load("weight", 0, torch.zeros(4, 16))  # a pre-sliced tensor is not what a file holds


def config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_config("llama", **overrides).to_dict())


def test_check_divisible_names_the_numbers_and_the_sizes_that_work():
    smollm2 = config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                     vocab_size=49152)
    check_divisible(smollm2, 3)
    with pytest.raises(FlotillaError, match=r"size 2 does not divide.*9 attention heads.*% 2 = 1.*"
                                            r"sizes that do: 1, 3$"):
        check_divisible(smollm2, 2)
    with pytest.raises(FlotillaError, match=r"2 KV heads \(num_key_value_heads\) % 4"):
        check_divisible(config(num_attention_heads=4, num_key_value_heads=2), 4)
    with pytest.raises(FlotillaError, match=r"100 intermediate size % 3"):
        check_divisible(config(num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                               intermediate_size=100, vocab_size=258), 3)
    with pytest.raises(FlotillaError, match=r"250 vocabulary rows \(vocab_size\) % 4 = 2"):
        check_divisible(config(vocab_size=250), 4)
    # INT4 packs 8 values a word: 2 ranks of 4 heads x 4 dims hold 8 query columns each, 4 ranks only 4
    packed = config(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                    vocab_size=256).with_quant(quant())
    check_divisible(packed, 2)
    with pytest.raises(FlotillaError, match=r"query width 4 is not a multiple of 8 \(4-bit values"):
        check_divisible(packed, 4)


def test_the_parallel_layers_refuse_sizes_that_do_not_divide():
    with tensor_parallel(TPGroup(0, 3)):
        with pytest.raises(FlotillaError, match="an axis of 64 does not divide among 3"):
            make_linear(64, [64], False, None, split="row")
        with pytest.raises(FlotillaError, match="an axis of 10 does not divide among 3"):
            make_embedding(10, 4)


def test_a_vocab_parallel_heads_gpu_logits_kernel_gathers_its_columns(monkeypatch):
    """On a GPU a half head's logits come from a GEMM writing fp32 (linear.mm_fp32_out); a
    vocabulary-parallel head's must still go through its with_kernel (the gather of the shards).
    Checked on the CPU with the GEMM stubbed: the branch is the device type and the dtype."""
    from flotilla.models import linear

    monkeypatch.setattr(linear, "mm_fp32_out", lambda w: lambda x: (x.float() @ w.float().t()))
    group = TPGroup(0, 2)
    with tensor_parallel(group):
        head = make_lm_head(16, 12)
    head.weight.data = torch.randn(6, 16).half()
    gathered = []
    monkeypatch.setattr(TPGroup, "gather_columns", lambda self, t: gathered.append(t) or t)
    fn = head.logits_fn(torch.device("cuda"))
    out = fn(torch.randn(3, 16).half())
    assert out.dtype == torch.float32 and len(gathered) == 1 and gathered[0] is out
    plain = LMHead(16, 12).half()
    assert plain.logits_fn(torch.device("cuda")) is not None  # the stub, no gather
    monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    assert plain.logits_fn(torch.device("cuda")) is None  # debugging: torch all the way
