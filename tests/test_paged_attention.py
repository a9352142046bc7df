"""The paged attention reference against dense causal attention computed per sequence."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels.attention import PagedAttentionMetadata, paged_attention, store_kv

BS, HKV, G, D = 4, 2, 3, 16


def build(seqs, num_blocks=64, seed=0, consecutive=False, released_behind=0):
    """seqs: [(cached_len, query_len)] with decodes (query_len 1) first. Returns the caches
    (with the cached prefixes written), the full per-sequence k/v, this step's q/k/v and meta.
    `released_behind` (a window): each table's blocks wholly behind the window of its first query are the null
    block, as the block manager leaves them, and their old blocks hold garbage."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))
    if not consecutive:
        rng.shuffle(free)
    else:
        free = free[::-1]  # pop() hands out 1, 2, 3, ...
    kc = torch.zeros(num_blocks, BS, HKV, D)
    vc = torch.zeros(num_blocks, BS, HKV, D)
    tables, full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, qlen in seqs:
        n = cached + qlen
        table = [free.pop() for _ in range(-(-n // BS))]
        tables.append(table)
        k = torch.randn(n, HKV, D, generator=gen)
        v = torch.randn(n, HKV, D, generator=gen)
        full_k.append(k)
        full_v.append(v)
        seq_slots = [table[p // BS] * BS + p % BS for p in range(n)]
        kc.view(-1, HKV, D)[seq_slots[:cached]] = k[:cached]
        vc.view(-1, HKV, D)[seq_slots[:cached]] = v[:cached]
        slots += seq_slots[cached:]
        qs.append(torch.randn(qlen, HKV * G, D, generator=gen))
        ks.append(k[cached:])
        vs.append(v[cached:])
    if released_behind:
        for (cached, _), table in zip(seqs, tables):
            for i in range(max(0, cached - released_behind + 1) // BS):
                kc[table[i]], vc[table[i]], table[i] = float("nan"), float("nan"), 0  # reused by another sequence
    width = max(len(t) for t in tables)
    nd = next((i for i, (_, q) in enumerate(seqs) if q != 1), len(seqs))
    dec, pre = seqs[:nd], seqs[nd:]
    meta = PagedAttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([c + q for c, q in seqs]),
        query_lens=torch.tensor([q for _, q in seqs]),
        block_size=BS,
        num_decodes=nd,
        max_decode_seq_len=max((c + q for c, q in dec), default=0),
        max_prefill_query_len=max((q for _, q in pre), default=0),
        max_prefill_seq_len=max((c + q for c, q in pre), default=0),
        first_block=tables[0][0] if consecutive and len(seqs) == 1 else -1,
        min_decode_pos=min((c for c, _ in dec), default=0),
        min_prefill_pos=min((c for c, _ in pre), default=0),
    )
    return kc, vc, full_k, full_v, torch.cat(qs), torch.cat(ks), torch.cat(vs), meta


def dense_reference(seqs, full_k, full_v, q):
    outs, row = [], 0
    for (cached, qlen), k, v in zip(seqs, full_k, full_v):
        qq = q[row:row + qlen].transpose(0, 1)  # [Hq, Q, D]
        kk = k.repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, S, D]
        vv = v.repeat_interleave(G, dim=1).transpose(0, 1)
        mask = torch.ones(qlen, cached + qlen, dtype=torch.bool).tril(diagonal=cached)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1))
        row += qlen
    return torch.cat(outs)


CASES = {
    "one-decode": [(9, 1)],
    "decodes": [(9, 1), (0, 1), (31, 1), (4, 1)],
    "one-prefill": [(0, 13)],
    "prefill-after-prefix": [(8, 5)],
    "prefills": [(0, 13), (8, 1 + 4), (3, 2), (12, 20)],
    "mixed": [(5, 1), (17, 1), (0, 7), (12, 9), (4, 1 + 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_dense(case):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D))
    want = dense_reference(seqs, full_k, full_v, q)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["one-decode", "one-prefill", "prefill-after-prefix"])
def test_one_sequence_in_consecutive_blocks_reads_a_view(case):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs, consecutive=True)
    assert meta.first_block == 1
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D))
    assert meta.plan().contiguous is not None and meta.plan().decode_gather is None
    assert (got - dense_reference(seqs, full_k, full_v, q)).abs().max().item() < 1e-5


def test_store_kv_writes_exact_slots_and_nothing_else():
    seqs = [(3, 1), (0, 6)]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    before = kc.clone()
    store_kv(kc, vc, k, v, meta)
    flat_before, flat_after = before.view(-1, HKV, D), kc.view(-1, HKV, D)
    changed = (flat_before != flat_after).any(-1).any(-1).nonzero().view(-1)
    assert sorted(changed.tolist()) == sorted(meta.slot_mapping.tolist())
    assert torch.equal(flat_after[meta.slot_mapping], k)
    assert not kc[0].any(), "the null block was written"


def test_decode_alone_and_in_a_padded_batch_agree():
    """A decode row alone (no padding, no mask) and next to longer sequences (padded, masked).
    Not bit-identical: SDPA's reductions depend on the padded length."""
    seqs = [(9, 1), (40, 1), (2, 1), (23, 1)]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    store_kv(kc, vc, k, v, meta)
    together = paged_attention(q, kc, vc, meta, scale=0.25)
    for b in range(len(seqs)):
        alone = PagedAttentionMetadata(meta.slot_mapping[b:b + 1], meta.block_tables[b:b + 1], meta.seq_lens[b:b + 1],
                                       meta.query_lens[b:b + 1], BS, 1, int(meta.seq_lens[b]), 0, 0)
        out = paged_attention(q[b:b + 1], kc, vc, alone, scale=0.25)
        assert (out[0] - together[b]).abs().max().item() < 1e-6


def windowed_reference(seqs, full_k, full_v, q, window):
    """dense_reference where query i (position cached + i) sees keys cached + i - window < j <= cached + i."""
    outs, row = [], 0
    for (cached, qlen), k, v in zip(seqs, full_k, full_v):
        qq = q[row:row + qlen].transpose(0, 1)
        kk = k.repeat_interleave(G, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(G, dim=1).transpose(0, 1)
        pos = torch.arange(qlen)[:, None] + cached
        j = torch.arange(cached + qlen)[None, :]
        mask = (j <= pos) & (j > pos - window)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1))
        row += qlen
    return torch.cat(outs)


@pytest.fixture(params=["compiled", "torch"])
def cpu_kernels(request, monkeypatch):
    """The CPU decode in the compiled extension, or torch's gather and mask (FLOTILLA_KERNEL=dense)."""
    from flotilla.kernels.cpu import ops

    if request.param == "torch":
        monkeypatch.setenv("FLOTILLA_KERNEL", "dense")
    ops.reset()
    yield request.param
    ops.reset()


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sliding_window_matches_the_dense_window(case, window, cpu_kernels):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=window)
    assert (got - windowed_reference(seqs, full_k, full_v, q, window)).abs().max().item() < 1e-5
    # a window no sequence of the step reaches past is the plain causal attention, through the plain plan
    longest = max(c + n for c, n in seqs)
    assert meta.plan(window=longest) is meta.plan()
    full = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=longest)
    assert (full - dense_reference(seqs, full_k, full_v, q)).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_window_reads_nothing_of_the_blocks_given_back_behind_it(case, window, cpu_kernels):
    """The blocks behind each sequence's window are the null block in its table and their old blocks hold NaN
    (another sequence's now): nothing of theirs reaches the output (the torch path gathers from the first block
    a query of the step can see; the kernels read each sequence's window)."""
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs, released_behind=window)
    if len(seqs) == 1:  # a lone sequence's step reads no null block either (no padding): not gathered at all
        kc[0], vc[0] = float("nan"), float("nan")
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=window)
    assert (got - windowed_reference(seqs, full_k, full_v, q, window)).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["one-decode", "one-prefill", "prefill-after-prefix"])
def test_a_sliding_window_over_consecutive_blocks(case, cpu_kernels):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs, consecutive=True)
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=4)
    assert (got - windowed_reference(seqs, full_k, full_v, q, 4)).abs().max().item() < 1e-5


def capped_reference(seqs, full_k, full_v, q, softcap, window=0):
    """windowed_reference with each score s capped at softcap * tanh(s / softcap) (Gemma 2), computed by hand."""
    outs, row = [], 0
    for (cached, qlen), k, v in zip(seqs, full_k, full_v):
        qq = q[row:row + qlen].transpose(0, 1)
        kk = k.repeat_interleave(G, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(G, dim=1).transpose(0, 1)
        s = qq @ kk.transpose(-1, -2) / math.sqrt(D)
        s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(qlen)[:, None] + cached
        j = torch.arange(cached + qlen)[None, :]
        visible = (j <= pos) & ((j > pos - window) if window else True)
        outs.append((s.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).transpose(0, 1))
        row += qlen
    return torch.cat(outs)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_soft_capped_scores_match_the_hand_computed_attention(case, window, cpu_kernels):
    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    q = q * 4  # scores large enough for the cap to bite
    store_kv(kc, vc, k, v, meta)
    got = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=window, softcap=2.0)
    assert (got - capped_reference(seqs, full_k, full_v, q, 2.0, window)).abs().max().item() < 1e-5
    plain = paged_attention(q, kc, vc, meta, scale=1 / math.sqrt(D), window=window)
    assert (got - plain).abs().max().item() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("case", sorted(CASES))
def test_soft_capped_scores_in_slices_of_queries_are_the_same(case, monkeypatch):
    """sdpa's soft-capped path bounds the fp32 scores it holds (a long prefill's): in slices of queries down to one
    row, the same attention."""
    from flotilla.kernels import attention

    seqs = CASES[case]
    kc, vc, full_k, full_v, q, k, v, meta = build(seqs)
    store_kv(kc, vc, k, v, meta)
    whole = paged_attention(q * 4, kc, vc, meta, scale=1 / math.sqrt(D), window=3, softcap=2.0)
    monkeypatch.setattr(attention, "SOFTCAP_SCORES", 1)
    sliced = paged_attention(q * 4, kc, vc, meta, scale=1 / math.sqrt(D), window=3, softcap=2.0)
    assert (sliced - whole).abs().max().item() < 1e-6
