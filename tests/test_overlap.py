"""The engine's overlap (a decode launched before the previous one's tokens are read) gives exactly
the synchronous engine's tokens: on the echo executor (which reads every token back through the
KV cache, so a wrong input token, slot or freed block shows), and on a tiny random model through
the ModelRunner's device path (eager, and the CUDA-graph static buffers run eagerly on the CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from flotilla.runtime.cuda_graphs import DecodeGraphRunner, DecodeInputs
from flotilla.runtime.engine import EngineConfig, LLMEngine
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec
from flotilla.runtime.model_runner import ModelRunner
from flotilla.runtime.random_model import build_random_model
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.scheduler import SchedulerConfig

from fake_executor import check_echo_tokens, echo_engine


def drive(engine: LLMEngine, requests, abort_at: dict[int, str] | None = None, max_steps: int = 10_000):
    """Add (id, prompt, params) requests, step to the end, aborting request `abort_at[step]` at
    that step; returns {id: (tokens, finish reason)} and checks the pool after every step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid, _, _ in requests}
    for n in range(max_steps):
        if not engine.has_unfinished():
            break
        if abort_at and n in abort_at and abort_at[n] in engine.seqs:
            engine.abort(abort_at[n])
            out[abort_at[n]] = (out[abort_at[n]][0], "abort")
        for o in engine.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        engine.check_integrity()
    else:
        raise AssertionError("not finished")
    return out


def echo_requests(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 40), stop_token_ids=(rng.randrange(3, vocab),),
                                ignore_eos=i % 3 == 0)
        reqs.append((f"r{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("rows_alone", [True, False])
def test_echo_overlap_gives_the_synchronous_tokens(rows_alone):
    """Many requests with max_tokens, stop tokens and EOS (vocab 40: stops come often), joined
    in two waves, one aborted: identical tokens and finish reasons, every block back at the end."""
    reqs = echo_requests(12, vocab=40, seed=3)
    eos = (7,)
    kw = dict(num_blocks=80, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, eos=eos, vocab_size=40)
    sync = echo_engine(**kw)
    want = drive(sync, reqs, abort_at={9: "r5"})
    engine = echo_engine(**kw, overlap=True, rows_alone=rows_alone)
    got = drive(engine, reqs, abort_at={9: "r5"})
    assert got == want
    assert engine.executor.num_launched > 20  # it really overlapped
    assert any(s.prev_rows is not None for s in engine.executor.steps)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    reasons = {r for _, r in want.values()}
    assert {"stop", "length", "abort"} <= reasons
    for rid, prompt, _ in reqs:
        if rid != "r5":
            check_echo_tokens(prompt, got[rid][0], vocab_size=40)


def test_echo_overlap_under_block_pressure_and_long_contexts():
    """A pool too small for everyone: preemption and recomputation happen on the synchronous
    path; tokens stay identical and the pool consistent."""
    rng = random.Random(1)
    reqs = [(f"q{i}", [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 20))],
             SamplingParams(max_tokens=rng.randrange(10, 60), ignore_eos=True)) for i in range(10)]
    kw = dict(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=48)
    want = drive(echo_engine(**kw), reqs)
    engine = echo_engine(**kw, overlap=True)
    assert drive(engine, reqs) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_stop_discards_the_row_scheduled_after_it():
    """One request stopping at a stop token: the step launched after it computed one more token,
    which is never returned, and its slot's block is freed with the rest."""
    want = drive(echo_engine(vocab_size=50), [("a", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))])
    stop = want["a"][0][5]  # the sixth token, as a stop token: the request ends at its first one
    first = want["a"][0].index(stop)
    engine = echo_engine(vocab_size=50, overlap=True)
    got = drive(engine, [("a", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))])
    assert got["a"] == (want["a"][0][:first + 1], "stop")
    # the prefill samples token 0, decode k samples token k: decodes 1..first returned tokens, and
    # one more was launched after the stop (from the second decode on, each reads the previous)
    decodes = [s for s in engine.executor.steps if s.num_decodes == s.num_seqs]
    assert len(decodes) == first + 1
    assert decodes[-1].prev_rows == [0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------------------------- real model

def model_engine(model, overlap: bool, graphs: bool, max_num_seqs: int = 8) -> LLMEngine:
    cfg = model.config
    spec = KVCacheSpec(tuple(model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, torch.float32, 4)
    cache = KVCache(spec, 160, torch.device("cpu"))
    runner = ModelRunner(model, cache, max_model_len=256)
    if graphs:  # the static-buffer path that a CUDA graph replays, run eagerly
        runner.graphs = DecodeGraphRunner(model, cache, (1, 2, 4, 8), 256, runner.scale, capture=False,
                                          sampled=runner.sampled)
    config = EngineConfig(num_blocks=160, block_size=4, max_model_len=256,
                          scheduler=SchedulerConfig(max_num_seqs, 256), overlap=overlap)
    return LLMEngine(runner, config, None, (2,), cfg.vocab_size)


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model("tiny", 16, "cpu", torch.float32, seed=4)


@pytest.mark.parametrize("graphs", [False, True])
@torch.inference_mode()
def test_model_overlap_gives_the_synchronous_tokens(tiny_model, graphs):
    """Greedy and seeded requests with stop tokens taken from the synchronous run (so they hit
    mid-way), max_tokens, EOS and an abort: the tokens of the synchronous engine, exactly."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 3, 14, 7, 11)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.7, min_p=0.05, seed=2, ignore_eos=True)]
    reqs = [(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    free_run = drive(model_engine(tiny_model, False, graphs), reqs)
    stops = {0: free_run["m0"][0][6], 3: free_run["m3"][0][10]}  # stop tokens met mid-way
    reqs = [(rid, p, SamplingParams(**{**sp.__dict__, "stop_token_ids": (stops[i],)}) if i in stops else sp)
            for i, (rid, p, sp) in enumerate(reqs)]
    want = drive(model_engine(tiny_model, False, graphs), reqs, abort_at={12: "m4"})
    engine = model_engine(tiny_model, True, graphs)
    launched, launch = [], engine.executor.launch
    engine.executor.launch = lambda step: launched.append(step) or launch(step)
    got = drive(engine, reqs, abort_at={12: "m4"})
    assert got == want
    assert sum(1 for s in launched if s.prev_rows is not None) > 15  # decodes read their tokens on the device
    assert want["m0"][1] == "stop" and want["m3"][1] == "stop" and want["m4"][1] == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_graph_inputs_take_tokens_from_the_sampled_buffer():
    """Rows with a previous row read the sampled buffer on the device; the others their token."""
    sampled = torch.tensor([40, 41, 42, 0])
    inputs = DecodeInputs(size=4, width=3, block_size=4, device=torch.device("cpu"), no_prev=3)
    inputs.fill([0, 12, 0], [5, 0, 2], [[3, 7], [9], [4]], prev_rows=[2, -1, 0])
    assert (inputs.token_ids + sampled[inputs.prev_rows]).tolist() == [42, 12, 40, 0]
    inputs.fill([4], [2], [[8]])  # no previous rows: every row reads the zero entry
    assert inputs.prev_rows.tolist() == [3, 3, 3, 3]


def test_graph_inputs_rewrite_only_changed_tables_and_keep_the_device_in_step():
    """Tables are rewritten when their list is replaced; the partial copy leaves the device
    buffer equal to the host's after any sequence of steps."""
    inputs = DecodeInputs(size=4, width=4, block_size=2, device=torch.device("cpu"))
    a, b, c = [3, 7], [9], [5, 6, 1]
    inputs.fill([1, 2, 3], [3, 1, 5], [a, b, c])
    assert torch.equal(inputs.device_buf, inputs.host_buf)
    inputs._tables[0, 0] = -5  # a row holding the same list is not rewritten...
    inputs.fill([1, 2, 3], [4, 2, 6], [a, b, c])
    assert inputs.host_views()[4][0, 0] == -5
    a = a + [8]  # ...a replaced list is
    inputs.fill([1, 2, 3], [4, 2, 6], [a, b, c])
    assert inputs.block_tables.tolist()[0] == [3, 7, 8, 0]
    steps = [([a], [1]), ([a, b, c, [2]], [1, 1, 1, 1]), ([c, b], [1, 1]), ([[4, 4], c], [2, 1]), ([c], [1])]
    for tables, qlens in steps:
        tokens = [1] * sum(qlens)
        inputs.fill(tokens, [1] * len(tables), tables, query_lens=qlens)
        assert torch.equal(inputs.device_buf, inputs.host_buf)
    assert inputs.block_tables.tolist() == [[5, 6, 1, 0]] + [[0] * 4] * 3
