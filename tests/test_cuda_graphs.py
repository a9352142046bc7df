"""The decode-graph runner's logic on CPU: bucket choice, static buffer filling and padding, and
the static-buffer path (what a CUDA graph replays, run eagerly here) against the eager runner."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flotilla.kernels.gptq import GPTQWeight
from flotilla.models.linear import QuantLinear
from flotilla.runtime.cuda_graphs import BUCKETS, DecodeGraphRunner, DecodeInputs, bucket_for, capture_sizes
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec, PagedAttentionBackend
from flotilla.runtime.model_runner import ModelRunner, StepInput, prepare_step
from flotilla.runtime.random_model import build_random_model, weight_bytes
from flotilla.runtime.sampler import SamplingBatch
from flotilla.runtime.sampling import SamplingParams


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 32)
    assert capture_sizes(1000) == BUCKETS  # beyond the largest bucket: eager
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_a_capture_holds_the_cycle_collector_off():
    """While a graph is captured no cycle collection may run (it could free an earlier engine's CUDA graph,
    which a capturing stream forbids): the collector is off inside and as it was after."""
    import gc

    from flotilla.runtime.cuda_graphs import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError), _collector_paused():
            raise RuntimeError("a failed capture")
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, sizes) is None


def test_fill_writes_each_field_and_pads_the_rest():
    inputs = DecodeInputs(size=4, width=3, block_size=4, device=torch.device("cpu"))
    inputs.fill([11, 12], [5, 0], [[3, 7], [9]])
    tok, pos, slot, lens, tables = inputs.host_views()
    assert tok.tolist() == [11, 12, 0, 0]
    assert pos.tolist() == [5, 0, 0, 0]
    assert slot.tolist() == [7 * 4 + 1, 9 * 4 + 0, 0, 0]  # position 5 is in logical block 1 (= 7), offset 1
    assert lens.tolist() == [6, 1, 1, 1]  # padding rows: one token of context, in the null block
    assert tables.tolist() == [[3, 7, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]
    # the device views read the same buffer
    assert inputs.token_ids.tolist() == [11, 12, 0, 0] and inputs.slot_mapping.tolist() == [29, 36, 0, 0]
    assert inputs.block_tables.tolist() == tables.tolist()
    inputs.fill([4], [2], [[8]])  # a smaller step leaves nothing stale behind
    assert inputs.token_ids.tolist() == [4, 0, 0, 0] and inputs.seq_lens.tolist() == [3, 1, 1, 1]
    assert inputs.block_tables.tolist() == [[8, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    meta = inputs.metadata()
    assert meta.num_decodes == 4 and meta.max_decode_seq_len == 12 and meta.first_block == -1


def test_random_model_has_symmetric_uniform_codes_and_finite_logits():
    model = build_random_model("tiny", bits=4, device="cpu", dtype=torch.float32, seed=3, keep_source=True)
    lin = model.model.layers["0"].mlp.down_proj
    assert isinstance(lin, QuantLinear)
    w = GPTQWeight(lin.qweight, lin.qzeros, lin.scales, lin.g_idx, 4, 128)
    assert torch.equal(w.zeros(), torch.full_like(w.zeros(), 8))
    codes = w.codes()
    assert set(codes.unique().tolist()) == set(range(1, 16))  # centred on the zero: weights of mean zero
    assert abs((codes.float() - 8).mean().item()) < 0.15  # ~6 sigma here; codes 0..15 gave -0.5
    assert bool((lin.scales > 0).all())
    assert weight_bytes(model) > model.lm_head.weight.numel() * 4
    cache = KVCache(KVCacheSpec((0, 1), 2, 32, torch.float32, 4), 8, torch.device("cpu"))
    runner = ModelRunner(model, cache, graph_sizes=(1, 2))
    assert runner.graphs is None  # CPU: graphs are never captured; the eager path is untouched
    out = runner.execute(step([[1, 2, 3]], [0], [[1]], sample=True))
    assert len(out.token_ids) == 1


def test_deep_random_model_residual_grows_like_a_random_walk(monkeypatch):
    """The layers' deltas of a random model are uncorrelated, so the residual's spread grows like the square
    root of the depth (with weights of nonzero mean it grew linearly: llama-3-70b overflowed fp16 at layer 35)."""
    import flotilla.models.llama as llama

    model = build_random_model("tiny", bits=4, device="cpu", dtype=torch.float32, num_layers=64)
    cfg = model.config
    cache = KVCache(KVCacheSpec(tuple(range(64)), cfg.num_key_value_heads, cfg.head_dim, torch.float32, 4), 32,
                    torch.device("cpu"))
    runner = ModelRunner(model, cache)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (4, 24), generator=gen).tolist()
    spread = {}
    inner = llama.layer_residual

    def recorded(ops, x, delta, cos, sin, attn):
        out = inner(ops, x, delta, cos, sin, attn)
        spread[ops.layer] = out[0].std().item()
        return out

    monkeypatch.setattr(llama, "layer_residual", recorded)
    runner.execute(step(prompts, [0] * 4, [[1 + 6 * b + i for i in range(6)] for b in range(4)]))
    assert spread[63] / spread[15] < 3  # a random walk: ~2 (sqrt of 4); the old codes measured 5.8


def step(new_tokens, starts, tables, sample=True) -> StepInput:
    rows = [(SamplingParams(temperature=0), 0, [], []) for _ in new_tokens]
    decodes = sum(1 for t in new_tokens if len(t) == 1)
    return StepInput([f"r{i}" for i in range(len(new_tokens))], [t for ts in new_tokens for t in ts], starts,
                     [len(t) for t in new_tokens], tables, decodes, [sample] * len(new_tokens),
                     SamplingBatch.build(rows))


def eager_logits(runner: ModelRunner, s: StepInput) -> torch.Tensor:
    positions, meta, _ = prepare_step(s, runner.block_size, runner.device)
    x = torch.tensor(s.token_ids, dtype=torch.long)
    return runner.compute_logits(s, runner.model(x, positions, PagedAttentionBackend(runner.cache, meta, runner.scale)))


@torch.inference_mode()
def test_static_buffer_decode_matches_the_eager_runner_step_after_step():
    bs = 4
    model = build_random_model("tiny", bits=4, device="cpu", dtype=torch.float32, seed=1)
    spec = KVCacheSpec((0, 1), 2, 32, torch.float32, bs)
    eager = ModelRunner(model, KVCache(spec, 40, torch.device("cpu")))
    static = ModelRunner(model, KVCache(spec, 40, torch.device("cpu")))
    graphs = DecodeGraphRunner(model, static.cache, (1, 4), max_model_len=64, scale=static.scale, capture=False)
    assert graphs.width == 16
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, 512, n).tolist() for n in (5, 17, 9)]
    tables = [[3, 9], [1, 2, 4, 30, 31], [7, 6, 5]]  # blocks out of order, room for 3 more tokens each
    prefill = step(prompts, [0, 0, 0], tables)
    want = eager_logits(eager, prefill)
    torch.testing.assert_close(eager_logits(static, prefill), want)
    tokens = want.argmax(-1).tolist()
    starts = [len(p) for p in prompts]
    for _ in range(3):  # three decode steps of 3 sequences in a bucket of 4 (one padding row)
        decode = step([[t] for t in tokens], starts, tables)
        assert graphs.can_run(decode.token_ids, decode.query_lens, decode.block_tables)
        want = eager_logits(eager, decode)
        got = graphs.run(decode.token_ids, decode.starts, decode.block_tables)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(-1).tolist()
        starts = [s + 1 for s in starts]
    # the same keys and values landed in the same slots; only the null block differs (padding)
    torch.testing.assert_close(static.cache.storage[:, :, 1:], eager.cache.storage[:, :, 1:], rtol=1e-5, atol=1e-5)
    assert not torch.equal(static.cache.storage[:, :, 0], eager.cache.storage[:, :, 0])
    # a prefill, too many sequences or a table wider than the graphs' are left to the eager path
    assert not graphs.can_run(prefill.token_ids, prefill.query_lens, prefill.block_tables)
    assert not graphs.can_run([1] * 5, [1] * 5, [[1]] * 5)
    assert not graphs.can_run([1], [1], [list(range(1, 18))])


def test_fill_gives_each_token_of_a_sequence_its_own_row():
    inputs = DecodeInputs(size=8, width=3, block_size=4, device=torch.device("cpu"))
    inputs.fill([11, 12, 13, 21, 31, 32], [3, 9, 0], [[3, 7], [5, 6, 8], [2]], query_lens=[3, 1, 2])
    tok, pos, slot, lens, tables = inputs.host_views()
    assert tok.tolist() == [11, 12, 13, 21, 31, 32, 0, 0]
    assert pos.tolist() == [3, 4, 5, 9, 0, 1, 0, 0]
    assert lens.tolist() == [4, 5, 6, 10, 1, 2, 1, 1]  # each row's context ends at its own token
    assert slot.tolist() == [3 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1, 8 * 4 + 1, 2 * 4, 2 * 4 + 1, 0, 0]
    assert tables.tolist() == [[3, 7, 0]] * 3 + [[5, 6, 8]] + [[2, 0, 0]] * 2 + [[0, 0, 0]] * 2
    inputs.fill([4], [2], [[8]])  # back to one sequence: nothing stale
    assert inputs.block_tables.tolist() == [[8, 0, 0]] + [[0, 0, 0]] * 7 and inputs.seq_lens.tolist() == [3] + [1] * 7


def verify_step(tokens, drafts, starts, tables) -> StepInput:
    """Each sequence's decoded token followed by its drafts, every row sampled (greedy)."""
    new = [[t] + d for t, d in zip(tokens, drafts)]
    rows = [(SamplingParams(temperature=0), 0, [], []) for ts in new for _ in ts]
    return StepInput([f"r{i}" for i in range(len(new))], [t for ts in new for t in ts], starts,
                     [len(t) for t in new], tables, sum(len(t) == 1 for t in new), [True] * len(new),
                     SamplingBatch.build(rows), spec_token_ids=drafts)


@torch.inference_mode()
def test_verify_steps_replay_one_row_per_token_like_the_eager_runner():
    """Speculative verify steps (1 + k tokens a sequence, k differing by sequence) through the
    static buffers match the eager runner's logits and leave the same keys and values."""
    bs = 4
    model = build_random_model("tiny", bits=4, device="cpu", dtype=torch.float32, seed=2)
    spec = KVCacheSpec((0, 1), 2, 32, torch.float32, bs)
    eager = ModelRunner(model, KVCache(spec, 40, torch.device("cpu")))
    static = ModelRunner(model, KVCache(spec, 40, torch.device("cpu")))
    static.graphs = DecodeGraphRunner(model, static.cache, (4, 8), max_model_len=64, scale=static.scale,
                                      capture=False, max_query_len=4)
    gen = np.random.default_rng(1)
    prompts = [gen.integers(0, 512, n).tolist() for n in (6, 11)]
    tables = [[5, 2, 9, 12, 13], [1, 3, 4, 30, 31, 32]]
    prefill = step(prompts, [0, 0], tables)
    assert not static._replays(prefill)  # 11 tokens of one sequence: more than max_query_len
    torch.testing.assert_close(static.execute(prefill).token_ids, eager.execute(prefill).token_ids)
    tokens = eager_logits(eager, prefill).argmax(-1).tolist()
    starts = [6, 11]
    for drafts in ([[7, 8, 9], [4]], [[], [1, 2]], [[3, 3, 3], [5, 6, 7]]):
        s = verify_step(tokens, drafts, starts, tables)
        assert static._replays(s)
        want = eager_logits(eager, s)
        got = static.logits(s)
        assert got.shape == want.shape == (s.num_tokens, 512)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert static.execute(s).token_ids == eager.execute(s).token_ids
        tokens = [int(want[sum(s.query_lens[:b + 1]) - 1].argmax()) for b in range(2)]
        starts = [st + q for st, q in zip(starts, s.query_lens)]
    torch.testing.assert_close(static.cache.storage[:, :, 1:], eager.cache.storage[:, :, 1:], rtol=1e-5, atol=1e-5)
    # a catch-up pass (two tokens, the last one sampled): the graph's rows are narrowed to it
    s = step([[3], [1, 2]], starts[::-1], tables[::-1])  # decodes first
    assert static._replays(s)
    torch.testing.assert_close(static.logits(s), eager_logits(eager, s), rtol=1e-4, atol=1e-4)
