"""The hybrid KV cache: a model whose layers are of two kinds (Gemma 2 and 3: sliding-window and global layers)
deals its layers into groups of one kind, each with its own table over one pool of group-sized blocks, the sliding
groups keeping only the window's blocks (runtime/block_manager.HybridBlockManager). Block tables against hand-worked cases, and the engine's tokens and
logprobs against the same engine keeping every block for every layer (--disable-hybrid-kv-cache-manager)."""
from __future__ import annotations

import pytest
import torch

from flotilla.runtime.block_manager import HybridBlockManager
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.sequence import Sequence

from conftest import make_hf_model, save_byte_tokenizer, save_hf_model
from test_gemma import gemma2_config, gemma3_config


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=64, ignore_eos=True), (), 256)


def step(bm: HybridBlockManager, s: Sequence, n: int) -> None:
    assert bm.allocate_slots(s, n) is not None
    s.num_computed_tokens += n
    bm.check_integrity()


def test_the_sliding_group_gives_back_its_blocks_and_the_whole_context_group_keeps_them():
    """One pool of 11 blocks, 4-token blocks, group 0 whole-context, group 1 in an 8-token window. After the step
    that computes positions from 11 on, no sliding layer reads a key before position 4: group 1's block 0 goes
    back (the null block takes its place), group 0's stays."""
    bm = HybridBlockManager(num_blocks=12, windows=(0, 8), block_size=4)
    s = seq("a", list(range(100, 111)))  # 11 prompt tokens
    step(bm, s, 11)
    assert len(s.block_table) == len(s.group_tables[1]) == 3 and bm.num_free_blocks == 11 - 6
    assert not set(s.block_table) & set(s.group_tables[1])  # each group in blocks of its own
    head = s.group_tables[1][0]
    s.token_ids.append(7)
    step(bm, s, 1)  # position 11: the window reaches back to 4
    assert s.group_tables[1][0] == 0 and bm.num_free_blocks == 11 - 5 and bm.num_window_released == 1
    assert bm.pool.blocks[head].ref_cnt == 0
    for t in range(12, 20):  # positions 12..19: a block more in each group, group 1's blocks 1 and 2 go back
        s.token_ids.append(t)
        step(bm, s, 1)
    assert len(s.block_table) == 5 and 0 not in s.block_table
    assert s.group_tables[1][:3] == [0, 0, 0] and 0 not in s.group_tables[1][3:] and len(s.group_tables[1]) == 5
    assert bm.num_free_blocks == 11 - 5 - 2
    bm.free(s)
    assert s.block_table == s.group_tables[1] == [] and bm.num_free_blocks == 11
    bm.check_integrity()


def test_an_allocation_short_for_any_group_changes_none():
    bm = HybridBlockManager(num_blocks=8, windows=(0, 8), block_size=4)  # 7 usable blocks
    a, b = seq("a", list(range(12))), seq("b", list(range(50, 58)))
    step(bm, a, 12)  # 3 blocks in each group
    assert not bm.has_room(b, 8) and bm.allocate_slots(b, 8) is None  # 2 + 2 needed, 1 free
    assert not bm.holds(b) and b.block_table == [] and b.group_tables == {} and bm.num_free_blocks == 1
    assert not bm.has_room_for_decodes([a])  # a's 13th token starts a block in each group
    bm.check_integrity()


def test_a_prefix_hit_is_the_longest_prefix_every_group_holds():
    """A finished sequence's blocks stay cached, each group's under its own keys (the same tokens' keys and
    values in other layers are other blocks). A second request with the same 20 tokens finds 4 blocks in group
    0 (one token is left to compute), and in group 1 the blocks its next query (position 16) reads: from
    position 9 on, blocks 2 and 3; its blocks 0 and 1, cached too, are not taken (they would go back at once)
    and the null block stands for them. The hit is 16 tokens."""
    bm = HybridBlockManager(num_blocks=16, windows=(0, 8), block_size=4)
    prompt = list(range(200, 220))
    a = seq("a", prompt)
    step(bm, a, 20)
    whole, sliding = list(a.block_table), list(a.group_tables[1])
    assert len(whole) == len(sliding) == 5 and 0 not in sliding  # one step read every position: nothing went back
    bm.free(a)
    b = seq("b", prompt)
    computed, tokens = bm.get_computed_blocks(b)
    assert tokens == 16 and len(computed) == 4
    assert bm.allocate_slots(b, 4, computed) is not None
    assert b.block_table[:4] == whole[:4] and b.group_tables[1][:4] == [0, 0] + sliding[2:4]
    assert bm.num_free_blocks == 15 - (4 + 1) - (2 + 1)
    bm.check_integrity()


def test_groups_of_equal_size_from_each_kind():
    from flotilla.runtime.kv_cache import hybrid_groups

    gemma3_1b = [0 if i % 6 == 5 else 512 for i in range(26)]  # 4 global layers, 22 sliding
    groups, windows = hybrid_groups(tuple(range(26)), lambda i: gemma3_1b[i])
    assert groups[0] == (5, 11, 17, 23) and windows == (0,) + (512,) * 6
    assert groups[-1] == (24, 25, None, None) and all(len(g) == 4 for g in groups)
    assert sorted(i for g in groups for i in g if i is not None) == list(range(26))
    assert hybrid_groups((0, 1, 2), lambda i: 0) == ((), ()) and hybrid_groups((0, 1), lambda i: 8) == ((), ())


# ------------------------------------------------------------------------------------------------ the engine
def _engine(path, hybrid: bool, graphs: bool = False, **kw):
    from flotilla.runtime.cuda_graphs import DecodeGraphRunner
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model

    args = EngineArgs(block_size=4, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=not hybrid, **kw)
    engine = build_engine(load_model(path, "cpu", "float32", progress=False), args)
    assert (type(engine.block_manager) is HybridBlockManager) == hybrid
    if graphs:  # the graph runner's static inputs, run eagerly on the CPU (as on CUDA, less the capture)
        runner = engine.executor
        runner.graphs = DecodeGraphRunner(runner.model, runner.cache, (1, 2, 4), 256, runner.scale, capture=False,
                                          sampled=runner.sampled)
    return engine


def _run(engine, prompts, rounds, params):
    """Each round's requests at once, to the end: {name: [(token, logprob)]}; integrity checked every step."""
    got = {k: [] for k in prompts}
    for names in rounds:
        for name in names:
            engine.add_request(name, prompts[name], params)
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [(t, lp) for t, lp in zip(out.new_token_ids, out.logprobs or [0.0] * len(out.new_token_ids))]
            engine.check_integrity()
    return got


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    hf = make_hf_model(gemma3_config() if request.param == "gemma3" else gemma2_config(), seed=11)
    save_hf_model(hf, path)
    save_byte_tokenizer(path)
    return path


PROMPTS = {"a": list(range(30, 57)), "b": list(range(90, 101)), "c": list(range(30, 57)) + [5, 6, 7],
           "d": [3] * 40, "e": list(range(120, 126))}
ROUNDS = [["a", "b", "d"], ["c", "e"], ["a"]]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-inputs"])
def test_the_hybrid_cache_gives_the_same_tokens_and_logprobs(model, graphs):
    """Prefills in 16-token chunks, decodes past the window, prefix hits (c extends a; a again), and the window
    pool's blocks given back, with and without the decode graphs' static inputs."""
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=True)
    want = _run(_engine(model, False), PROMPTS, ROUNDS, params)
    engine = _engine(model, True, graphs)
    got = _run(engine, PROMPTS, ROUNDS, params)
    assert engine.block_manager.num_window_released > 0 and engine.stats().cached_tokens_total > 0
    for name in PROMPTS:
        assert [t for t, _ in got[name]] == [t for t, _ in want[name]], name
        assert max(abs(x - y) for (_, x), (_, y) in zip(got[name], want[name])) < 1e-4, name


def test_the_hybrid_cache_under_preemption_and_speculative_decoding(model):
    """A full pool of few blocks (sequences preempted and recomputed) and n-gram drafts (rejected drafts' blocks
    truncated in both groups): the same tokens as the plain cache in the same setting."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_memory="240KiB", speculative="ngram", num_speculative_tokens=3)
    want = _run(_engine(model, False, **kw), PROMPTS, [list(PROMPTS)], params)
    engine = _engine(model, True, **kw)
    got = _run(engine, PROMPTS, [list(PROMPTS)], params)
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_window_released > 0
    assert got == want


def test_the_hybrid_cache_holds_more_tokens_in_the_same_memory(model):
    """The same --kv-cache-memory: the whole-context group's share holds several times the tokens of sequences
    longer than the window (Gemma 3 here: 1 global layer of 7; Gemma 2: 2 of 4), and the report says so."""
    kw = dict(kv_cache_memory="1MiB")
    plain, hybrid = _engine(model, False, **kw), _engine(model, True, **kw)
    assert hybrid.config.context_len == plain.config.context_len == 256
    spec = hybrid.executor.cache.spec
    whole = sum(1 for w in spec.group_windows if not w)
    assert (hybrid.block_manager.num_blocks // whole) >= 1.9 * plain.block_manager.num_blocks
    assert "hybrid:" in hybrid.kv_cache_report and "hybrid" not in plain.kv_cache_report
    assert hybrid.executor.cache.reserved_bytes <= plain.executor.cache.reserved_bytes


def test_no_group_takes_another_groups_prefix_hit_as_a_new_block():
    """A review's finding: group 0 took its new blocks from the free queue before group 1 had taken its hit's
    blocks out of it, so it could evict one of them and take it; group 1 then took the same block as its hit, and
    the two groups' layers wrote one block. Every group's hit is taken first now; over many pool sizes and
    histories, no block is in two groups' tables."""
    bs = 4
    for num_blocks in range(14, 40, 3):
        for other in range(4, 60, 8):
            for extra in range(1, 30, 4):
                bm = HybridBlockManager(num_blocks + 1, (0, 8), block_size=bs)
                a = seq("a", list(range(100, 116)) + [1, 2, 3, 4, 5, 6, 7, 8])
                step(bm, a, 16)
                for _ in range(8):
                    step(bm, a, 1)
                bm.free(a)
                b = seq("b", list(range(900, 900 + other)))
                if bm.has_room(b, other):
                    step(bm, b, other)
                    bm.free(b)
                c = seq("c", list(range(100, 116)) + list(range(500, 500 + extra)))
                computed, n = bm.get_computed_blocks(c)
                if bm.allocate_slots(c, c.num_tokens - n, computed) is not None:
                    bm.check_integrity()  # (a block in two groups' tables fails it)
                    assert not set(c.block_table) & (set(c.group_tables[1]) - {0})


def test_a_lone_prompt_as_long_as_the_plan_allows_is_prefilled_without_a_preemption():
    """A review's finding: a sliding group holds, while a step's new blocks are taken, the blocks of the window
    before that step's chunk too; the plan had not counted that chunk, so a prompt near the longest context the
    plan allowed preempted itself at its last chunk and started again, for ever."""
    import dataclasses

    from flotilla.runtime.kv_cache import KVCachePlan, KVCacheSpec, hybrid_plan
    from flotilla.runtime.scheduler import Scheduler, SchedulerConfig

    bs, window, chunk = 16, 256, 512
    spec = dataclasses.replace(KVCacheSpec((0, 1), 1, 8, torch.float32, bs), groups=((0,), (1,)), group_windows=(0, window))
    for memory_blocks, max_len in [(10_000, 4096), (300, 4096), (200, 4096)]:  # the cap binds, then the memory
        n, fit = hybrid_plan(spec, KVCachePlan(memory_blocks, ""), max_len, 1, chunk)
        bm = HybridBlockManager(n, (0, window), bs, enable_caching=False)
        sched = Scheduler(SchedulerConfig(1, chunk), bm)
        s = Sequence("a", list(range(fit - 1)), SamplingParams(max_tokens=1), (), fit)
        sched.add(s)
        while s.num_computed_tokens < fit - 1:
            out = sched.schedule()
            assert not out.preempted and out.scheduled, (memory_blocks, fit, s.num_computed_tokens)
            bm.check_integrity()


def test_graph_inputs_send_only_the_rows_that_changed_and_the_device_copy_stays_whole():
    """The decode graphs' static inputs of 3 groups: after any run of steps (tables grown, replaced, rows
    emptied, a verify step's rows), the device buffer equals the host twin; and a step that changes one row of
    many sends that row, not every row before it."""
    import random

    from flotilla.runtime.cuda_graphs import DecodeInputs

    rng = random.Random(3)
    inputs = DecodeInputs(size=8, width=6, block_size=4, device=torch.device("cpu"), groups=3)
    tables = [[[rng.randrange(1, 50)] for _ in range(8)] for _ in range(3)]
    sent = []
    real_copy = torch.Tensor.copy_
    for step_no in range(60):
        b = rng.randrange(8)
        for g in range(3):  # one sequence's tables grow (new lists: the engine never changes one in place)
            if len(tables[g][b]) < 6:
                tables[g][b] = tables[g][b] + [rng.randrange(1, 50)]
        n = rng.randrange(1, 9)
        starts = [len(tables[0][i]) * 4 - 1 for i in range(n)]
        sent.clear()
        torch.Tensor.copy_ = lambda self, src, non_blocking=False: (sent.append(self.numel()),
                                                                   real_copy(self, src, non_blocking))[1]
        try:
            if step_no % 7 == 6:  # a verify step: two tokens a sequence (the rows: tokens, at most 8)
                n = min(n, 4)
                inputs.fill([1] * 2 * n, [s - 1 for s in starts[:n]], [t[:] for t in tables[0][:n]], [2] * n,
                            group_tables=[[t[:] for t in g[:n]] for g in tables[1:]])
            else:
                inputs.fill([1] * n, starts, tables[0][:n], group_tables=[g[:n] for g in tables[1:]])
        finally:
            torch.Tensor.copy_ = real_copy
        assert torch.equal(inputs.device_buf, inputs.host_buf), step_no
        assert len(inputs.group_metadata()) == 2
    inputs.fill([1] * 8, [3] * 8, tables[0], group_tables=[g for g in tables[1:]])
    tables[0][5] = tables[0][5] + [7] if len(tables[0][5]) < 6 else tables[0][5][:1]
    sent.clear()
    torch.Tensor.copy_ = lambda self, src, non_blocking=False: (sent.append(self.numel()),
                                                               real_copy(self, src, non_blocking))[1]
    try:
        inputs.fill([1] * 8, [3] * 8, tables[0], group_tables=[g for g in tables[1:]])
    finally:
        torch.Tensor.copy_ = real_copy
    assert sent == [(5 + 2) * 8, 3 * 6]  # the fields, then row 5 alone
    assert torch.equal(inputs.device_buf, inputs.host_buf)


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_context_cut_by_the_kv_memory_is_said_and_the_line_says_what_fits(model, hybrid):
    """An audit's findings: a --max-model-len that the KV cache cannot hold was cut without a word, and the hybrid
    line's 'room for' counted every block as a global layer's."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model

    lines = []
    args = EngineArgs(block_size=4, max_num_batched_tokens=16, kv_cache_memory="100KiB", max_model_len=200,
                      disable_hybrid_kv_cache_manager=not hybrid)
    engine = build_engine(load_model(model, "cpu", "float32", progress=False), args, report=lines.append)
    context = engine.config.context_len
    assert context < 200 and any(f"holds contexts of up to {context} tokens, not the 200 of --max-model-len" in line
                                 for line in lines), lines
    if hybrid:
        assert f"room for 1 sequence of {context} tokens" in lines[0] or f"sequences of {context} tokens" in lines[0]


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_every_read_finds_what_its_group_wrote_under_random_histories(seed):
    """Random admissions (shared prefixes: prefix hits), chunks, decodes and frees over a small pool of 2 or 3
    groups: every key a query reads (its window, or the whole context) is in a block its group wrote for that
    very token history, and the manager's invariants hold after each change."""
    import random

    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    windows = rng.choice([(0, 5), (0, 8, 8), (0, 0, 6), (0, 3)])
    bm = HybridBlockManager(rng.randint(8, 40), windows, bs)
    written: dict[tuple[int, int], tuple[int, tuple]] = {}  # (block, slot) -> (group, the tokens up to it)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    live = []

    def compute(s: Sequence, start: int, n: int) -> None:
        tables = [s.block_table] + [s.group_tables[g] for g in range(1, len(windows))]
        for g, table in enumerate(tables):
            for pos in range(start, start + n):
                written[(table[pos // bs], pos % bs)] = (g, tuple(s.token_ids[:pos + 1]))
            for pos in range(start, start + n):
                for p in range(max(0, pos - windows[g] + 1) if windows[g] else 0, pos + 1):
                    assert table[p // bs] != 0 and written[(table[p // bs], p % bs)] == (g, tuple(s.token_ids[:p + 1]))
        s.num_computed_tokens = start + n

    for i in range(250):
        roll = rng.random()
        if roll < 0.3 or not live:
            s = seq(f"s{i}", rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))])
            computed, cached = bm.get_computed_blocks(s)
            n = min(s.num_tokens - cached, rng.randint(1, 8))
            if bm.allocate_slots(s, n, computed) is not None:
                compute(s, cached, n)
                live.append(s)
        elif roll < 0.8:
            s = rng.choice(live)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(rng.randint(0, 3))
            n = rng.randint(1, min(8, s.num_tokens - s.num_computed_tokens))
            if bm.allocate_slots(s, n) is not None:
                compute(s, s.num_computed_tokens, n)
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_integrity()
