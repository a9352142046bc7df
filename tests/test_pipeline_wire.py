"""Wire codec and authenticated connections: round trips, limits, hostile input, fuzzing."""
from __future__ import annotations

import dataclasses

import asyncio
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.runtime.pipeline.connection import (AuthError, Hello, client_handshake, server_handshake)
from flotilla.runtime.pipeline.wire import (ProtocolError, decode, encode, frame, message, read_frame)

TOKEN = b"0123456789abcdef-test-token"


@message("test.sample")
class Sample:
    step: int
    hidden: torch.Tensor
    positions: torch.Tensor | None
    block_tables: dict[str, list[int]]
    note: str


def sample(dtype=torch.float16) -> Sample:
    return Sample(3, torch.randn(4, 8).to(dtype), torch.arange(4), {"r1": [1, 2, 3]}, "hi")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64])
def test_round_trip(dtype):
    msg = sample(dtype)
    back = decode(encode(msg))
    assert isinstance(back, Sample) and back.step == 3 and back.note == "hi"
    assert back.hidden.dtype == dtype and torch.equal(back.hidden, msg.hidden)
    assert torch.equal(back.positions, msg.positions) and back.block_tables == {"r1": [1, 2, 3]}


def test_decode_rejects_hostile_frames():
    ok = msgpack.packb(["test.sample", [1, ["float16", [2], b"\0" * 4], None, {}, "x"]])
    assert isinstance(decode(ok), Sample)
    cases = {
        "unknown": msgpack.packb(["nope", []]),
        "arity": msgpack.packb(["test.sample", [1]]),
        "type": msgpack.packb(["test.sample", ["1", ["float16", [2], b"\0" * 4], None, {}, "x"]]),
        "bool-as-int": msgpack.packb(["test.sample", [True, ["float16", [2], b"\0" * 4], None, {}, "x"]]),
        "dtype": msgpack.packb(["test.sample", [1, ["object", [2], b"\0" * 4], None, {}, "x"]]),
        "size": msgpack.packb(["test.sample", [1, ["float16", [3], b"\0" * 4], None, {}, "x"]]),
        "shape": msgpack.packb(["test.sample", [1, ["float16", [-2], b"\0" * 4], None, {}, "x"]]),
        "ext": msgpack.packb(["test.sample", [msgpack.ExtType(1, b"x"), None, None, {}, "x"]]),
        "garbage": b"\xc1\xff\x00",
        "trailing": msgpack.packb(["test.sample", []]) + b"\x01",
        "not-a-list": msgpack.packb({"t": "test.sample"}),
    }
    for name, body in cases.items():
        with pytest.raises(ProtocolError):
            decode(body)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_decoder_raw_bytes(data):
    try:
        decode(data)
    except ProtocolError:
        pass


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["test.sample", "hello", "proof", "challenge", "x"]), st.lists(_json, max_size=6))
def test_fuzz_decoder_structured(name, fields):
    try:
        decode(msgpack.packb([name, fields], use_bin_type=True))
    except ProtocolError:
        pass


# ------------------------------------------------------------------------------------ handshake

async def _pair(server_token: bytes, client_token: bytes, max_frame: int = 1 << 20):
    """A server on loopback and a client; returns (server result or exception, client result or exception)."""
    result: dict = {}
    done = asyncio.Event()

    async def on_conn(reader, writer):
        try:
            result["server"] = await server_handshake(reader, writer, server_token, timeout=5, max_frame=max_frame)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            result["server"] = e
            writer.close()
        done.set()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        client = await client_handshake(reader, writer, client_token, "head", timeout=5, max_frame=max_frame)
    except Exception as e:  # noqa: BLE001
        client = e
    await asyncio.wait_for(done.wait(), 5)
    return srv, result["server"], client


def test_handshake_and_authenticated_frames():
    async def main():
        srv, server, client = await _pair(TOKEN, TOKEN)
        (sconn, name) = server
        assert name == "head"
        msg = sample()
        await client.send(msg)
        got = await sconn.recv()
        assert torch.equal(got.hidden, msg.hidden) and got.block_tables == msg.block_tables
        await sconn.send(Hello(1, b"x" * 32, "reply"))
        assert (await client.recv()).name == "reply"
        assert client.bytes_sent > 0 and sconn.bytes_received == client.bytes_sent
        srv.close()

    asyncio.run(main())


def test_wrong_token_fails_both_sides():
    async def main():
        srv, server, client = await _pair(TOKEN, b"another-token-of-16-bytes")
        assert isinstance(client, AuthError) and "token" in str(client)
        assert isinstance(server, AuthError) and "its token is likely not this worker's" in str(server)
        srv.close()

    asyncio.run(main())


def test_replayed_handshake_is_rejected():
    async def main():
        recorded: list[bytes] = []

        async def on_conn(reader, writer):
            try:
                conn, _ = await server_handshake(reader, writer, TOKEN, timeout=5)
                recorded.append(("ok", conn))
            except Exception as e:  # noqa: BLE001
                recorded.append(("fail", e))
                writer.close()

        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        # A genuine session, with the client's bytes captured.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = []
        orig_write = writer.write
        writer.write = lambda data: (sent.append(data), orig_write(data))[1]
        await client_handshake(reader, writer, TOKEN, "head", timeout=5)
        await asyncio.sleep(0.05)
        # An attacker replays the same bytes on a new connection.
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        for data in sent:
            w2.write(data)
        await w2.drain()
        await asyncio.sleep(0.2)
        assert recorded[0][0] == "ok"
        assert recorded[1][0] == "fail" and isinstance(recorded[1][1], AuthError)
        assert b"proof" not in await r2.read()  # the attacker got a challenge, then the door closed
        srv.close()

    asyncio.run(main())


def test_oversized_tampered_and_malformed_frames_are_protocol_errors():
    async def main():
        srv, server, client = await _pair(TOKEN, TOKEN, max_frame=1024)
        sconn, _ = server
        # Oversized: the length prefix alone is enough to refuse it.
        client.writer.write(struct.pack(">I", 10_000_000))
        await client.writer.drain()
        with pytest.raises(ProtocolError, match="exceeds"):
            await sconn.recv()
        srv.close()

        srv, server, client = await _pair(TOKEN, TOKEN)
        sconn, _ = server
        body = bytearray(b"\0" * 32 + msgpack.packb(["hello", [1, b"n" * 32, "x"]]))
        client.writer.write(frame(bytes(body)))  # a tag that is not the session's MAC
        await client.writer.drain()
        with pytest.raises(AuthError):
            await sconn.recv()
        srv.close()

    asyncio.run(main())


def test_read_frame_limits():
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", 5000) + b"x" * 10)
        with pytest.raises(ProtocolError):
            await read_frame(reader, 4096)

    asyncio.run(main())


def _step():
    from flotilla.runtime.pipeline.messages import SeqSampling, Step

    sampling = SeqSampling(4, 0.7, 40, 0.9, 0.0, 1.1, 0.0, 0.0, 7, -1, 12, [1, 2], [3], [], [], 0, [])
    return Step(2, 9, [4, 5], [12, 30], [1, 1], 2, [True, False], [[7], []], [sampling], [3], None,
                torch.randn(2, 8).half(), None, [[11], []], None, [[5, 2]])


def test_a_step_encodes_to_the_generic_form_and_back():
    """The per-message encoders give the bytes of the plain recursive form (every field through
    _to_wire), and decoding gives the step back."""
    from flotilla.runtime.pipeline.wire import _VALIDATORS, _to_wire

    step = _step()
    generic = msgpack.packb([step.WIRE_NAME, [_to_wire(getattr(step, f)) for f, _ in _VALIDATORS[type(step)]]],
                            use_bin_type=True)
    assert encode(step) == generic
    back = decode(generic)
    assert torch.equal(back.hidden, step.hidden)
    assert back == dataclasses.replace(step, hidden=back.hidden)


@pytest.mark.parametrize("field,value", [("handles", [4, True]), ("sample", [1, 0]), ("blocks", [[7.0], []]),
                                         ("starts", 12), ("query_lens", [1, "1"])])
def test_a_step_with_a_wrong_item_type_is_refused(field, value):
    from flotilla.runtime.pipeline.wire import _VALIDATORS

    step = _step()
    values = [msgpack.unpackb(encode(step))[1][i] if f != field else value
              for i, (f, _) in enumerate(_VALIDATORS[type(step)])]
    with pytest.raises(ProtocolError, match=field):
        decode(msgpack.packb([step.WIRE_NAME, values], use_bin_type=True))


def _result_frame(key: bytes, seq: int, msg, tamper: bool = False) -> bytes:
    import hmac as _hmac

    from flotilla.runtime.pipeline.connection import frame_tag
    body = encode(msg)
    tag = frame_tag(_hmac.new(key, digestmod="sha256"), seq, body)
    if tamper:
        tag = bytes([tag[0] ^ 1]) + tag[1:]
    return frame(tag + body)


@pytest.mark.parametrize("bad", ["tampered", "wrong type", "oversized", "closed"])
def test_the_result_channel_reads_step_results_and_reports_anything_else_once(bad):
    import socket

    from flotilla.runtime.pipeline.messages import Pong, StepResult
    from flotilla.runtime.pipeline.results import ResultChannel

    key = b"k" * 32
    a, b = socket.socketpair()
    lost: list[str] = []
    channel = ResultChannel(a, key, "peer", 1 << 16, spin=0.001, on_lost=lambda ch, why: lost.append(why))
    r0, r1 = StepResult(1, 7, [42], None, None, None), StepResult(1, 8, [43], None, None, None)
    b.sendall(_result_frame(key, 0, r0) + _result_frame(key, 1, r1)[:10])  # a whole frame and a piece
    assert [r.mb for r in channel.read(1.0)] == [7]
    b.sendall(_result_frame(key, 1, r1)[10:])
    assert [r.mb for r in channel.read(1.0)] == [8]
    assert channel.read(0.0) == [] and channel.read(0.01) == [] and not lost  # nothing more: nothing
    if bad == "tampered":
        b.sendall(_result_frame(key, 2, r0, tamper=True))
    elif bad == "wrong type":
        b.sendall(_result_frame(key, 2, Pong(1)))
    elif bad == "oversized":
        b.sendall(struct.pack(">I", (1 << 20)))
    else:
        b.close()
    assert channel.read(1.0) == [] and len(lost) == 1
    assert channel.read(0.01) == [] and len(lost) == 1  # reported once; reads nothing after
    channel.close()
    b.close()
