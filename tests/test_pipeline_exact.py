"""The pipeline's logits against an exact oracle: pp=1 with the wire's rounding put in by hand
(and, through a device lane, plain pp=1).

CPU stages compute in fp32 and hidden states cross the wire in fp16, so a fp32 ring is not
bit-equal to fp32 pp=1; on a random tiny model (nearly flat logits) greedy tokens then flip at
near-ties (bench/NOTES-gpu-pipeline.md, "Ties"). The exact oracle is pp=1 whose hidden states are
rounded to fp16 after the last layer of stage 0: the CPU's linear kernels are batch-invariant (a
row's output does not depend on the other rows), and the prompts are of one length (the torch
attention pads a step's sequences to its longest: unequal lengths would change its reduction
length), so every logit must match it, whatever micro-batches the ring cut. A wrong KV slot, position, block table, or an activation of another sequence or
step would move the logits by far more than the tolerance; the rounding itself moves them by more
too (checked, so the oracle is known to be the sharper one).
"""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from flotilla.runtime.engine_args import EngineArgs, build_engine
from flotilla.runtime.loader import load_model
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.random_model import write_random_checkpoint
from flotilla.runtime.sampling import SamplingParams

from pipeline_helpers import TOKEN, ThreadWorker

ARGS = EngineArgs(kv_cache_memory="8MiB", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
CUT = 1  # stage 0 holds layer 0, stage 1 layer 1
EXACT = 1e-5  # nats; the fp16 rounding alone moves these logprobs by ~1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("exact") / "tiny", 4, 128, 2, "cpu", 2)


@pytest.fixture(scope="module")
def prompts(ckpt):
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = random.Random(2)
    return [[rng.randrange(vocab) for _ in range(12)] for _ in range(6)]


def top2(engine, prompts) -> list[list[list[tuple[int, float]]]]:
    """Each request's top-2 (token, logprob) per generated token."""
    for i, p in enumerate(prompts):
        engine.add_request(f"x{i}", p, PARAMS)
    got: dict[str, list] = {f"x{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.top_logprobs or []
    return [got[f"x{i}"] for i in range(len(prompts))]


def local(ckpt, round_after: int | None):
    """pp=1 in fp32; `round_after`: hidden states rounded to fp16 after that many layers, as the
    wire does between stages."""
    lm = load_model(ckpt, "cpu", "float32", with_tokenizer=False, progress=False)
    model = lm.model
    engine = build_engine(lm, ARGS)  # freezes the model: forward runs model._frozen
    if round_after is not None:
        def forward(x, positions, attn, sampled=None):  # CausalLM.forward with the wire's rounding at the cut
            from flotilla.models.llama import layer_step
            h = model.embed(x if sampled is None else x + sampled[0].index_select(0, sampled[1]))
            cos, sin = model.rope.tables(positions, h.dtype)
            for i, ops in enumerate(model._frozen):
                if i == round_after:
                    h = h.to(torch.float16).to(torch.float32)
                h = layer_step(ops, h, cos, sin, attn)
            return model.model.norm(h)
        model.forward = forward
    return engine


def largest_gap(a, b) -> float:
    return max(abs(x[1] - y[1]) for ra, rb in zip(a, b) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb))


def prompt_logprobs(engine, prompts) -> list[list]:
    """Each request's prompt logprobs (top 3), 5-token prefill chunks."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    return [got[f"p{i}"] for i in range(len(prompts))]


def two_stages(ckpt, prompts, tmp_path, spin: float, run=top2, args=ARGS, wire: str = "fp16") -> tuple[list, list]:
    """The ring's top-2 per token (or what `run` returns), and its workers' stats."""
    workers = [ThreadWorker(tmp_path / f"cache{i}", ckpt, spin=spin) for i in range(2)]
    try:
        settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (CUT, 1), dtype="float32",
                                    spin_us=int(spin * 1e6), wire_dtype=wire)
        engine = build_pipeline_engine(ckpt, args, settings, lambda line: None, with_tokenizer=False)
        try:
            assert engine.executor.depth == 2  # two CPU stages: two micro-batches of 3 sequences in flight
            return run(engine, prompts), engine.executor.pipeline.worker_stats()
        finally:
            engine.close()
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("spin", [0.0, 0.002], ids=["sleeping", "polling"])
def test_two_stages_equal_pp1_with_the_wire_rounding(ckpt, prompts, tmp_path, spin, monkeypatch):
    """Also with the workers and the head polling between messages (spin.py, results.py). The
    hidden states on the wire: no device lane between the two workers of this process."""
    monkeypatch.setenv("FLOTILLA_LANES", "0")
    ring, stats = two_stages(ckpt, prompts, tmp_path, spin)
    assert stats[0].lane_sent == 0
    assert stats[0].decode_bytes >= 128 * 2 * stats[0].decode_tokens > 0  # hidden 128 in fp16 a decode token
    oracle = top2(local(ckpt, CUT), prompts)
    assert [[[t for t, _ in s] for s in r] for r in ring] == [[[t for t, _ in s] for s in r] for r in oracle]
    assert largest_gap(ring, oracle) <= EXACT
    plain = top2(local(ckpt, None), prompts)  # without the rounding: further off than the tolerance
    assert largest_gap(oracle, plain) > EXACT or any(
        [t for t, _ in s] != [t for t, _ in p] for o, q in zip(oracle, plain) for s, p in zip(o, q))


def test_two_stages_through_a_lane_equal_pp1_without_rounding(ckpt, prompts, tmp_path):
    """Through the device lane (one host: lane.py) the hidden states keep the stage's fp32, so
    the ring equals plain fp32 pp=1 (every step of these prompts fits a lane slot)."""
    ring, stats = two_stages(ckpt, prompts, tmp_path, 0.0)
    assert stats[0].lane_sent == stats[0].steps > 0 and stats[0].lane_refused == 0
    plain = top2(local(ckpt, None), prompts)
    assert [[[t for t, _ in s] for s in r] for r in ring] == [[[t for t, _ in s] for s in r] for r in plain]
    assert largest_gap(ring, plain) <= EXACT


def test_a_same_host_step_the_lane_cannot_take_keeps_the_stage_dtype_under_int8_wire(ckpt, prompts, tmp_path,
                                                                                     monkeypatch):
    """--wire-dtype int8 is for the network: a step that a same-host lane cannot take (before the next stage has
    accepted it, as right after start; a prefill past its slots) goes as a frame in the stage's own fp32, so the
    ring still equals plain fp32 pp=1 (an audit saw the first replies after start change under int8)."""
    from flotilla.runtime.pipeline import lane

    monkeypatch.setattr(lane.LaneOut, "put", lambda self, t: 0)  # every step: the lane not taking it
    ring, stats = two_stages(ckpt, prompts, tmp_path, 0.0, wire="int8")
    assert stats[0].lane_sent == 0 and stats[0].decode_bytes >= 128 * 4 * stats[0].decode_tokens > 0  # fp32 frames
    plain = top2(local(ckpt, None), prompts)
    assert [[[t for t, _ in s] for s in r] for r in ring] == [[[t for t, _ in s] for s in r] for r in plain]
    assert largest_gap(ring, plain) <= EXACT


def test_prompt_logprobs_through_two_stages_equal_pp1(ckpt, prompts, tmp_path):
    """The last stage computes the prompt's logprobs from its prefill chunks (protocol 11): through the lane,
    in fp32, they are plain pp=1's, values, ranks and top tokens."""
    args = dataclasses.replace(ARGS, max_num_batched_tokens=5, enable_prefix_caching=True)
    ring, _ = two_stages(ckpt, prompts, tmp_path, 0.0, prompt_logprobs, args)
    lm = load_model(ckpt, "cpu", "float32", with_tokenizer=False, progress=False)
    plain = prompt_logprobs(build_engine(lm, args), prompts)
    assert [len(r) for r in ring] == [len(p) for p in prompts]
    for r, q in zip(ring, plain):
        assert r[0] is None and q[0] is None
        for (lp, rank, top), (lp1, rank1, top1) in zip(r[1:], q[1:]):
            assert abs(lp - lp1) <= EXACT and rank == rank1 and [t for t, _ in top] == [t for t, _ in top1]


def test_a_neighbour_aborted_mid_flight_keeps_the_prompt_logprobs(ckpt, prompts, tmp_path):
    """A sequence aborted while its micro-batch is on the ring is dropped from the step's result
    (pipeline/engine._live); a scoring request in the same micro-batch keeps its prompt chunk's logprobs."""
    def run(engine, prompts):
        for i in range(5):
            engine.add_request(f"b{i}", prompts[i + 1][:3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        scored = (prompts[0] * 4)[:40]
        engine.add_request("a", scored, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        fill, aborted = engine._fill, []

        def fill_then_abort():  # once: abort a neighbour of "a" in a micro-batch that is in flight
            fill()
            for piece in engine._inflight.values():
                ids = [s.seq.request_id for s in piece.scheduled]
                if "a" in ids and not aborted:
                    other = next((r for r in ids if r != "a" and r in engine.seqs), None)
                    if other is not None:
                        engine.abort(other)
                        aborted.append(other)
        engine._fill = fill_then_abort
        got = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == "a" and o.prompt_logprobs is not None:
                    got = o.prompt_logprobs
        assert aborted, "no neighbour was in flight with the scoring request"
        return scored, got

    (scored, got), _ = two_stages(ckpt, prompts, tmp_path, 0.0, run,
                                  dataclasses.replace(ARGS, max_num_batched_tokens=16))
    assert len(got) == len(scored) and got[0] is None and all(e is not None for e in got[1:])


def test_a_sliding_window_model_through_a_lane_equals_pp1(ckpt, prompts, tmp_path, monkeypatch):
    """Mistral's shape (every layer in an 8-token window), 4-token blocks: the head gives back the blocks
    behind the window and the workers learn of it as counts (Step.nulls), each sequence keeping its handle;
    the ring's logits equal pp=1's."""
    import shutil

    from flotilla.runtime.pipeline.step_codec import StepEncoder
    win = tmp_path / "window"
    shutil.copytree(ckpt, win)
    cfg = json.loads((win / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    (win / "config.json").write_text(json.dumps(cfg))
    args = dataclasses.replace(ARGS, block_size=4)
    sent, encode = [], StepEncoder.encode
    monkeypatch.setattr(StepEncoder, "encode", lambda self, *a, **k: sent.append(encode(self, *a, **k)) or sent[-1])
    ring, _ = two_stages(win, prompts, tmp_path, 0.0, args=args)
    assert any(m.nulls for m in sent) and len({h for m in sent for h in m.handles}) == len(prompts)
    lm = load_model(win, "cpu", "float32", with_tokenizer=False, progress=False)
    engine = build_engine(lm, args)
    plain = top2(engine, prompts)
    assert engine.scheduler.block_manager.num_window_released > 0
    assert [[[t for t, _ in s] for s in r] for r in ring] == [[[t for t, _ in s] for s in r] for r in plain]
    assert largest_gap(ring, plain) <= EXACT


def test_a_context_the_pipelines_kv_memory_cannot_hold_is_said(ckpt, tmp_path):
    """As a single process says it (build_engine): the context the stages' pools hold, not the one asked for."""
    lines = []
    workers = [ThreadWorker(tmp_path / f"cache{i}", ckpt) for i in range(2)]
    try:
        settings = PipelineSettings(tuple(w.address for w in workers), LinkSettings(TOKEN), (CUT, 1), dtype="float32")
        engine = build_pipeline_engine(ckpt, dataclasses.replace(ARGS, kv_cache_memory="64KiB"), settings,
                                       lines.append, with_tokenizer=False)
        try:
            context = engine.config.context_len
            assert context < 256 and any(f"holds contexts of up to {context} tokens, not the 256 of --max-model-len"
                                         in line for line in lines), lines
        finally:
            engine.close()
    finally:
        for w in workers:
            w.stop()
