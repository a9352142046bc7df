"""Pipeline pieces on their own: the layer split, activations on the wire, the pipeline messages
(round trips and fuzzing), the shard receiver, the token rules."""
from __future__ import annotations

import argparse
import hashlib
import selectors
import socket

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.errors import FlotillaError
from flotilla.runtime.pipeline import messages as m
from flotilla.runtime.pipeline.activations import pack, unpack
from flotilla.runtime.pipeline.cli import read_token
from flotilla.runtime.pipeline.connection import parse_address
from flotilla.runtime.pipeline.partition import (StageBudget, compute_units, describe, parse_layers, split_layers,
                                                 stages_from_counts)
from flotilla.runtime.pipeline.spin import SpinSelector, spare_cores
from flotilla.runtime.pipeline.weight_push import ShardReceiver, WeightCache
from flotilla.runtime.pipeline.wire import ProtocolError, decode, encode, message_names

GiB = 1 << 30


def budget(name="w", free=8 * GiB, layer_bytes=100 << 20, head_bytes=200 << 20, layer_ms=1.0, head_ms=0.0):
    return StageBudget(name, free, layer_bytes, head_bytes, layer_ms, head_ms)


# ------------------------------------------------------------------------------- partition

def test_equal_workers_get_equal_shares_and_the_head_costs_the_last_stage():
    assert split_layers(30, [budget(), budget(), budget()]) == [10, 10, 10]
    assert split_layers(32, [budget(), budget(), budget()]) in ([11, 11, 10], [11, 10, 11], [10, 11, 11])
    a, b, c = split_layers(30, [budget(), budget(), budget(head_ms=4.0)])
    assert a + b + c == 30 and max(a, b, c + 4.0) == 12  # the best possible: 34 units over 3 stages
    assert c < min(a, b)


def test_a_faster_worker_gets_more_layers_and_memory_caps_a_small_one():
    assert split_layers(30, [budget(layer_ms=1.0), budget(layer_ms=2.0)]) == [20, 10]
    small = budget(free=int((5 * (100 << 20) + (200 << 20)) / 0.8) + 1)  # room for 5 layers beside its embeddings
    counts = split_layers(30, [small, budget(layer_ms=3.0), budget(layer_ms=3.0)])
    assert counts[0] == 5 and sum(counts) == 30


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(FlotillaError, match="do not fit"):
        split_layers(30, [budget(free=1 * GiB), budget(free=1 * GiB)])
    with pytest.raises(FlotillaError, match="more stages"):
        split_layers(2, [budget()] * 3)


def test_layers_override_is_checked():
    assert parse_layers("10,10,12", 32, 3) == [10, 10, 12]
    for text, pp, msg in [("10,10", 3, "2 stages"), ("10,10,10", 3, "adds up to 30"), ("a,b", 2, "comma"),
                          ("0,32", 2, "at least one")]:
        with pytest.raises(FlotillaError, match=msg):
            parse_layers(text, 32, pp)
    stages = stages_from_counts([10, 10, 12])
    assert [(s.start, s.end) for s in stages] == [(0, 10), (10, 20), (20, 32)]
    text = describe(stages, ["a:1", "b:2", "c:3"], "--layers")
    assert "stage 2  c:3  layers 20-31 (12) + lm_head" in text and "layers 0-9 (10) + embeddings" in text


def test_stages_on_one_gpu_take_turns_and_count_once_for_the_micro_batches():
    gpu0, gpu1, host = "gpu-GPU-aaaa", "gpu-GPU-bbbb", "m1/host/cpu"
    assert compute_units(["cuda:0", "cuda:0"], [gpu0, gpu0]) == 1
    assert compute_units(["cuda:0", "cuda:1"], [gpu0, gpu1]) == 2
    assert compute_units(["cuda:0", "cuda:0", "cpu"], [gpu0, gpu0, host]) == 2
    assert compute_units(["cpu", "cpu", "cpu"], [host] * 3) == 3  # CPU workers split the cores: they overlap


def test_addresses():
    assert parse_address("10.0.0.2:7070") == ("10.0.0.2", 7070)
    assert parse_address("gpu-box", 7070) == ("gpu-box", 7070)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ValueError):
        parse_address("host")
    with pytest.raises(ValueError):
        parse_address("host:99999")
    assert parse_address("::1", 7070) == ("::1", 7070)  # a bare IPv6 address with the default port
    with pytest.raises(ValueError, match="IPv6 address goes in brackets"):
        parse_address("bad:host:x", 7070)  # a typo, not an IPv6 address


# ----------------------------------------------------------------------------- activations

def test_fp16_bf16_and_int8_on_the_wire():
    h = torch.randn(5, 64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 50.0])[:, None]
    for name, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16)]:
        data, scales = pack(h, name)
        assert data.dtype == dtype and scales is None
        assert torch.equal(unpack(data, None, torch.float32, torch.device("cpu")), h.to(dtype).float())
    q, scales = pack(h, "int8")
    assert q.dtype == torch.int8 and scales.shape == (5,) and scales.dtype == torch.float32
    back = unpack(q, scales, torch.float32, torch.device("cpu"))
    assert ((back - h).abs() <= h.abs().amax(dim=1, keepdim=True) / 254 + 1e-6).all()  # half a step per token
    assert q.numel() + scales.numel() * 4 < h.to(torch.float16).numel() * 2 * 0.6


# -------------------------------------------------------------------------------- messages

def step_message(hidden=None, processed: bool = False) -> m.Step:
    """processed: the sampling row has a logit bias and min_tokens with its end tokens (protocol 10)."""
    extra = ([9, 17], [-100.0, 2.5], 3, [2, 5]) if processed else ([], [], 0, [])
    sampling = m.SeqSampling(7, 0.7, 40, 0.9, 0.0, 1.1, 0.0, 0.5, 2**62 + 5, 3, 12, [1, 2, 3], [4], *extra)
    return m.Step(3, 9, [7, 8], [12, 40], [1, 1], 2, [True, True], [[], [5]], [sampling], [2], [11, 22],
                  hidden, None)


def test_step_round_trip_with_nested_sampling_and_a_tensor():
    msg = step_message(torch.randn(2, 16).half(), processed=True)
    back = decode(encode(msg))
    assert back.sampling == msg.sampling and back.blocks == [[], [5]] and back.dropped == [2]
    assert (back.sampling[0].bias_values, back.sampling[0].min_tokens) == ([-100.0, 2.5], 3)
    assert torch.equal(back.hidden, msg.hidden) and back.scales is None


def test_decode_step_costs_little_beside_its_hidden_states():
    hidden = 576
    one = len(encode(step_message(torch.zeros(2, hidden, dtype=torch.float16)))) - 2 * hidden * 2
    assert one < 150  # for two sequences, with a first-time sampling row in it


def test_nested_messages_are_validated():
    good = encode(step_message())
    obj = msgpack.unpackb(good)
    obj[1][8][0][1] = "hot"  # temperature as a string
    with pytest.raises(ProtocolError, match="temperature"):
        decode(msgpack.packb(obj))
    obj = msgpack.unpackb(good)
    obj[1][8][0] = obj[1][8][0][:3]  # a truncated nested message
    with pytest.raises(ProtocolError, match="fields"):
        decode(msgpack.packb(obj))


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=16)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(message_names()), st.lists(_values, max_size=14))
def test_fuzz_every_pipeline_message(name, fields):
    """Random field values under every registered message name decode or raise ProtocolError."""
    try:
        decode(msgpack.packb([name, fields], use_bin_type=True))
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_steps(data):
    """Real Step frames with bytes flipped, cut or inserted decode or raise ProtocolError."""
    body = bytearray(encode(step_message(torch.zeros(2, 4, dtype=torch.float16))))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            body[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del body[i:i + data.draw(st.integers(1, 8))]
        else:
            body[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        if not body:
            body = bytearray(b"\x90")
    try:
        decode(bytes(body))
    except ProtocolError:
        pass


# ------------------------------------------------------------------------------ weight push

def test_shard_receiver_checks_order_size_and_sha256(tmp_path):
    data = b"x" * 1000 + b"y" * 24
    good = {"model-00001-of-00002.safetensors": hashlib.sha256(data).hexdigest(),
            "model-00002-of-00002.safetensors": hashlib.sha256(b"other").hexdigest()}
    r = ShardReceiver(tmp_path, good, ["model-00001-of-00002.safetensors"])
    r.chunk(m.FileChunk("model-00001-of-00002.safetensors", 0, data[:600]))
    r.chunk(m.FileChunk("model-00001-of-00002.safetensors", 600, data[600:]))
    r.end(m.FileEnd("model-00001-of-00002.safetensors", len(data)))
    assert r.done and (tmp_path / "model-00001-of-00002.safetensors").read_bytes() == data
    bad = ShardReceiver(tmp_path, good, ["model-00002-of-00002.safetensors"])
    bad.chunk(m.FileChunk("model-00002-of-00002.safetensors", 0, b"tampered"))
    with pytest.raises(FlotillaError, match="sha256"):
        bad.end(m.FileEnd("model-00002-of-00002.safetensors", 8))
    assert not (tmp_path / "model-00002-of-00002.safetensors").exists()
    assert not list(tmp_path.glob(".*part"))
    for name, offset in [("../../etc/passwd", 0), ("model-00002-of-00002.safetensors", 5)]:
        r = ShardReceiver(tmp_path, good, ["model-00002-of-00002.safetensors"])
        with pytest.raises(FlotillaError):
            r.chunk(m.FileChunk(name, offset, b"abc"))
        r.abort()


def test_weight_cache_refuses_what_the_head_should_not_send(tmp_path):
    cache = WeightCache(tmp_path)
    req = m.LoadStage("../x", {}, {"a": "b"}, 0, 1, 2, "auto", 0, 0.0, 64, 1, 1, 16, 0)
    with pytest.raises(FlotillaError, match="fingerprint"):
        cache.prepare(req)
    req = m.LoadStage("a" * 64, {"../../evil": "x"}, {"a": "b"}, 0, 1, 2, "auto", 0, 0.0, 64, 1, 1, 16, 0)
    with pytest.raises(FlotillaError, match="unexpected file"):
        cache.prepare(req)
    req = m.LoadStage("a" * 64, {}, {}, 0, 1, 2, "auto", 0, 0.0, 64, 1, 1, 16, 0)
    with pytest.raises(FlotillaError, match="cannot be pushed"):
        cache.prepare(req)


# ---------------------------------------------------------------------------------- tokens

def test_the_token_comes_from_a_file_the_environment_or_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLOTILLA_TOKEN", raising=False)
    ns = lambda **kw: argparse.Namespace(**{"token": None, "token_file": None, **kw})  # noqa: E731
    assert read_token(ns(token="0123456789abcdefgh")) == b"0123456789abcdefgh"
    assert "ps" in capsys.readouterr().err  # accepted, with a warning that others can read it
    with pytest.raises(FlotillaError, match="one way"):
        read_token(ns(token="0123456789abcdefgh", token_file="x"))
    with pytest.raises(FlotillaError, match="needs a shared token"):
        read_token(ns())
    assert read_token(ns(), required=False) is None
    f = tmp_path / "token"
    f.write_text("short\n")
    with pytest.raises(FlotillaError, match="at least 16"):
        read_token(ns(token_file=str(f)))
    f.write_text("0123456789abcdef-from-file\n")
    assert read_token(ns(token_file=str(f))) == b"0123456789abcdef-from-file"
    monkeypatch.setenv("FLOTILLA_TOKEN", "0123456789abcdef-from-env")
    assert read_token(ns()) == b"0123456789abcdef-from-env"


class _Polls(selectors.DefaultSelector):
    """Records the timeouts SpinSelector passes down (it inherits from DefaultSelector; this sits
    between them in the MRO)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.timeouts: list[float | None] = []

    def select(self, timeout=None):
        self.timeouts.append(timeout)
        return super().select(timeout)


class _CountingSpin(SpinSelector, _Polls):
    pass


def test_the_spin_selector_polls_after_a_step_and_only_while_allowed():
    a, b = socket.socketpair()
    allowed = [True]
    sel = _CountingSpin(60.0, lambda: allowed[0])
    sel.register(a, selectors.EVENT_READ)
    assert sel.select(0.01) == [] and sel.timeouts == [0.01]  # cold: sleeps at once
    b.send(b"x")
    assert len(sel.select(None)) == 1
    a.recv(1)
    sel.timeouts.clear()
    assert sel.select(0.01) == [] and sel.timeouts == [0.01]  # any event is not a step: still cold
    sel.arm()  # a step came: hot for the next 60 s
    sel.timeouts.clear()
    assert sel.select(0.01) == []  # nothing comes: polls (timeout 0) until the 10 ms are up
    assert sel.timeouts.count(0) >= 1 and all(t == 0 or t <= 0.01 for t in sel.timeouts)
    allowed[0] = False
    sel.timeouts.clear()
    assert sel.select(0.01) == [] and sel.timeouts == [0.01]  # not allowed (a prefill computes): sleeps
    sel.close()
    a.close()
    b.close()


def test_local_rings_poll_only_with_cores_to_spare():
    assert spare_cores(16, [None, None])  # two GPU workers and the head: 3 busy threads
    assert spare_cores(16, [1, 1, 1])  # bench/pp_hop.py's CPU workers of one thread
    assert not spare_cores(2, [1, 1])  # this CI machine: the head and two CPU stages already fill it
    assert not spare_cores(16, [1, 14, 1])  # a mixed ring: the CPU stage has the cores the GPU workers leave


def test_a_worker_logs_a_refused_host_once_a_minute_with_the_count_since(monkeypatch, caplog):
    """A head with the wrong token retries every few seconds: its worker says so once per REFUSAL_LOG_S, not each
    time, and then how many more it refused meanwhile; every refusal is counted."""
    import types

    from flotilla.runtime.pipeline import worker

    clock = [100.0]
    monkeypatch.setattr(worker.time, "monotonic", lambda: clock[0])
    me = types.SimpleNamespace(rejected=0, _refusals={})
    me._warn_limited = types.MethodType(worker.Worker._warn_limited, me)
    writer = types.SimpleNamespace(get_extra_info=lambda key: ("10.0.0.2", 40000 + int(clock[0])))
    with caplog.at_level("WARNING", logger=worker.log.name):
        for _ in range(3):
            worker.Worker._refused(me, writer, "the peer does not know the token")
            clock[0] += 2
        worker.Worker._refused(me, writer, "another reason")
        clock[0] += worker.REFUSAL_LOG_S
        worker.Worker._refused(me, writer, "the peer does not know the token")
    lines = [r.getMessage() for r in caplog.records]
    assert me.rejected == 5
    assert lines == ["refused a connection from 10.0.0.2: the peer does not know the token",
                     "refused a connection from 10.0.0.2: another reason",
                     "refused a connection from 10.0.0.2: the peer does not know the token (2 more like it since, "
                     "not logged)"]
