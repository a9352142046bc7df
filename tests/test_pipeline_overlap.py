"""Overlapped decodes on a real ring (two worker stages over TCP, tiny random model, CPU): the
head sends each decode before it has read the step before, stage 0 takes its input tokens from
the ids the last stage feeds it; the tokens and finish reasons must be the plain ring's, greedy
and seeded sampling, with stop tokens met mid-way and an abort of a sequence in flight.

One engine runs the plain ring and the overlapped one in turn (`engine.overlap`), on the same
workers: the same batches reach the stages either way (a step sent ahead holds exactly the
sequences the plain schedule would; one with a finished sequence is dropped and recomputed), so
the tokens are equal bit for bit, not within a tolerance.
"""
from __future__ import annotations

import json
import random

import pytest

from flotilla.runtime.engine_args import EngineArgs
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.random_model import write_random_checkpoint
from flotilla.runtime.sampling import SamplingParams

from pipeline_helpers import TOKEN, ThreadWorker

ARGS = EngineArgs(kv_cache_memory="8MiB", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
TOKENS = 20
ABORTED = "x3"  # aborted once it has 5 tokens: it is in the step in flight and in the one sent ahead


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ckpt = write_random_checkpoint("tiny", tmp_path_factory.mktemp("overlap") / "tiny", 4, 128, 3, "cpu", 2)
    workers = [ThreadWorker(tmp_path_factory.mktemp(f"cache{i}"), ckpt) for i in range(2)]
    settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (1, 1), dtype="float32",
                                micro_batches=1)
    engine = build_pipeline_engine(ckpt, ARGS, settings, lambda line: None, with_tokenizer=False)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    try:
        yield engine, vocab, workers, ckpt
    finally:
        engine.close()
        for w in workers:
            w.stop()


def requests(vocab: int, stops: dict[str, int]) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(5)
    out = []
    for i in range(6):
        stop = (stops[f"x{i}"],) if f"x{i}" in stops else ()
        params = SamplingParams(max_tokens=TOKENS - i, temperature=0.0 if i % 2 else 0.8, seed=100 + i,
                                stop_token_ids=stop, ignore_eos=True)
        out.append((f"x{i}", [rng.randrange(vocab) for _ in range(6 + i)], params))
    return out


def drive(engine, reqs, abort: bool, on_step=lambda n: None) -> dict[str, tuple[list[int], str | None]]:
    out = {rid: ([], None) for rid, _, _ in reqs}
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    for n in range(10_000):
        if not engine.has_unfinished():
            break
        on_step(n)
        if abort and len(out[ABORTED][0]) >= 5 and ABORTED in engine.seqs:
            engine.abort(ABORTED)
            out[ABORTED] = (out[ABORTED][0], "abort")
        for o in engine.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out


def test_overlapped_ring_equals_the_plain_ring(ring):
    engine, vocab, _, _ = ring
    assert engine.executor.depth == 1 and engine.overlap  # one micro-batch in flight: overlapped by default
    engine.overlap = False
    free = drive(engine, requests(vocab, {}), abort=False)
    # stop tokens met mid-way: x0 and x4 stop at their 8th token, x1 at its 3rd
    stops = {"x0": free["x0"][0][7], "x1": free["x1"][0][2], "x4": free["x4"][0][7]}
    reqs = requests(vocab, stops)
    plain = drive(engine, reqs, abort=True)
    engine.overlap = True
    ahead, dropped = engine.num_ahead, engine.num_dropped
    overlapped = drive(engine, reqs, abort=True)
    assert overlapped == plain
    assert plain["x1"][1] == "stop" and plain[ABORTED][1] == "abort" and plain["x5"][1] == "length"
    assert engine.num_ahead - ahead > 10  # decodes really went ahead (of ~19 decode steps)
    assert engine.num_dropped - dropped >= 2  # the stops and the abort dropped steps sent ahead
    stats = engine.executor.pipeline.worker_stats()
    assert stats[0].steps > 0 and stats[1].bytes_sent > 0
    # one host: the hidden states and the fed ids went through the device lanes (lane.py), and
    # some prefill chunks too long for a slot through the frames
    assert stats[0].lane_sent > 10 and stats[1].lane_sent > 10


def test_stage_0_lost_while_decodes_go_ahead(ring):
    """Stage 0 (which holds the feedback link's far end and the parked step) dies mid-way and
    comes back: the ring rewinds, re-prefills, and the tokens are the undisturbed ones."""
    engine, vocab, workers, ckpt = ring
    reqs = requests(vocab, {})
    engine.overlap = False
    want = drive(engine, reqs, abort=False)
    engine.overlap = True
    rewinds = engine.num_rewinds

    def kill(n: int) -> None:
        if n == 6:
            port = workers[0].port
            workers[0].stop()
            workers[0] = ThreadWorker(workers[0].config.cache_dir, ckpt, port=port)

    assert drive(engine, reqs, abort=False, on_step=kill) == want
    assert engine.num_rewinds == rewinds + 1


def test_stage_0_gate_keeps_the_order_and_fills_the_tokens():
    """A decode sent ahead waits for the ids of the step it names, and every step behind it
    waits too; its tokens come from those ids by row; rows that do not fit are an error."""
    from flotilla.runtime.pipeline.feed import FeedGate
    from flotilla.runtime.pipeline.messages import Sampled, Step

    def step(mb, tokens, prev_mb=0, rows=None):
        n = len(tokens)
        return Step(1, mb, list(range(n)), [5] * n, [1] * n, n, [True] * n, [[]] * n, [], [], tokens, None, None,
                    prev_mb=prev_mb, prev_rows=rows, feed=True)

    gate = FeedGate()
    assert [s.mb for s in gate.step(step(1, [7, 8]))] == [1]
    assert gate.step(step(2, [0, 0, 9], 1, [1, 0, -1])) == [] and gate.step(step(3, [4])) == []
    assert len(gate) == 2 and gate.parked_steps == 1
    assert gate.sampled(Sampled(1, 0, [1])) == []  # not the ids step 2 waits for
    out = gate.sampled(Sampled(1, 1, [30, 31]))
    assert [(s.mb, s.token_ids, s.prev_rows) for s in out] == [(2, [31, 30, 9], None), (3, [4], None)]
    assert gate._fed == {}  # ids of steps before the last one let through are forgotten
    gate.sampled(Sampled(1, 3, [44]))
    assert [s.token_ids for s in gate.step(step(4, [0], 3, [0]))] == [[44]]
    gate.sampled(Sampled(1, 4, [1]))
    with pytest.raises(ValueError, match="rows"):
        gate.step(step(5, [0], 4, [3]))
