"""A pipeline worker's block-table mirror feeds CUDA-graph inputs correctly when a preempted sequence
comes back with a trimmed table and new blocks of the same length (a review finding: the mirror
trimmed in place, and the graph inputs, which skip a row holding the same list at the same length,
kept the old block id, so the decode wrote and read another request's KV)."""
from __future__ import annotations

import torch

from flotilla.runtime.cuda_graphs import DecodeGraphRunner, DecodeInputs
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec
from flotilla.runtime.model_runner import ModelRunner, StepInput
from flotilla.runtime.pipeline.step_codec import StageSequences, StepEncoder
from flotilla.runtime.random_model import build_random_model
from flotilla.runtime.sampler import SamplingBatch
from flotilla.runtime.sampling import SamplingParams


def _decode(table: list[int], start: int) -> StepInput:
    return StepInput(request_ids=["x"], token_ids=[11], starts=[start], query_lens=[1], block_tables=[table],
                     num_decodes=1, sample=[False], sampling=SamplingBatch.build([]))


def test_graph_inputs_see_a_trimmed_and_regrown_table():
    enc, mirror = StepEncoder(), StageSequences()
    inputs = DecodeInputs(size=1, width=4, block_size=4, device=torch.device("cpu"))
    first = mirror.apply(enc.encode(_decode([5, 6, 7], 10), 1, 0), is_last=False)
    inputs.fill(first.token_ids, first.starts, first.block_tables)
    msg = enc.encode(_decode([5, 6, 9], 10), 1, 1)  # preempted, back: 5, 6 from the prefix cache, 9 new
    assert msg.trims and msg.blocks == [[9]]
    second = mirror.apply(msg, is_last=False)
    inputs.fill(second.token_ids, second.starts, second.block_tables)
    assert inputs.block_tables[0, :3].tolist() == [5, 6, 9]
    assert int(inputs.slot_mapping[0]) == 9 * 4 + 10 % 4


def _runner(model, graphs: bool) -> ModelRunner:
    cfg = model.config
    spec = KVCacheSpec(tuple(model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, torch.float32, 4)
    cache = KVCache(spec, 16, torch.device("cpu"))
    runner = ModelRunner(model, cache, max_model_len=64)
    if graphs:  # the graph runner's static inputs, run eagerly on the CPU
        runner.graphs = DecodeGraphRunner(model, cache, (1, 2, 4), 64, runner.scale, capture=False,
                                          sampled=runner.sampled)
    return runner


def test_a_stage_on_graph_inputs_equals_the_engines_steps_through_a_preemption():
    torch.manual_seed(0)
    model = build_random_model("tiny", 16, "cpu", torch.float32, seed=4)
    x, y = [5, 9, 17, 33, 41, 60, 7, 8], [100, 101, 102, 103, 104]

    def step(rid, toks, start, n, table):
        return StepInput(request_ids=[rid], token_ids=toks[start:start + n], starts=[start], query_lens=[n],
                         block_tables=[table], num_decodes=int(n == 1), sample=[True],
                         sampling=SamplingBatch.build([(SamplingParams(temperature=0), 0, [], [])], [0]))

    steps = [step("x", x, 0, 6, [1, 2]), step("x", x, 6, 1, [1, 2]),
             step("y", y, 0, 5, [2, 3]),  # x preempted; y takes its block 2
             step("x", x, 4, 3, [1, 5]),  # x back: block 1 cached, block 5 new
             step("x", x, 7, 1, [1, 5])]  # a decode in the same graph row, a table of the same length
    with torch.inference_mode():
        engine, stage = _runner(model, False), _runner(model, True)
        enc, mirror = StepEncoder(), StageSequences()
        for i, s in enumerate(steps):
            want = engine.logits(s)
            got = stage.logits(mirror.apply(enc.encode(s, 1, i), is_last=False))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"step {i}")


def test_blocks_released_behind_a_sliding_window_travel_as_a_count():
    """The head's table loses its first blocks to the null block as a window slides: the workers' mirror
    gets a count (Step.nulls), not the table again, and ends with the head's table."""
    enc, mirror = StepEncoder(), StageSequences()
    tables = [[3, 4, 5], [0, 4, 5], [0, 4, 5, 6], [0, 0, 5, 6], [0, 0, 0, 6, 7]]
    for i, table in enumerate(tables):
        msg = enc.encode(_decode(table, 10 + 4 * i), 1, i)
        got = mirror.apply(msg, is_last=False)
        assert got.block_tables == [table]
        assert not msg.trims and not msg.dropped and msg.handles == [1]
        assert sum(len(b) for b in msg.blocks) == (3 if i == 0 else len(table) - len(tables[i - 1]))
    assert enc.encode(_decode(tables[-1], 30), 1, 9).nulls is None  # nothing new released: no count


def test_a_window_release_and_a_regrown_tail_in_one_step():
    """Nulls at the head and a different tail (rejected drafts gave the last block back, a new one taken):
    the count, then a trim, then the new block."""
    enc, mirror = StepEncoder(), StageSequences()
    mirror.apply(enc.encode(_decode([3, 4, 5], 10), 1, 0), is_last=False)
    msg = enc.encode(_decode([0, 4, 9], 14), 1, 1)
    assert msg.nulls == [[1, 1]] and msg.trims == [[1, 2]] and msg.blocks == [[9]]
    assert mirror.apply(msg, is_last=False).block_tables == [[0, 4, 9]]
