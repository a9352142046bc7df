"""The pipeline end to end on a tiny random Llama, with workers on threads of this process (fast):
outputs against the local engine, hostile connections, weight push with counted bytes, a stage
lost and restarted, the stage timeout, TLS.

The tiny model runs in float16 on every side, so activations in fp16 on the wire are exact: tokens
must match the local engine exactly, and logprobs up to the batch-shape variance of fp16 matmuls
(micro-batches group the sequences differently from the local engine's one batch).
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import msgpack
import pytest

from flotilla.models.checkpoint import Manifest
from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
from flotilla.runtime.loader import load_model
from flotilla.runtime.pipeline.connection import (AuthError, _mac, client_handshake, connect, frame,
                                                  server_handshake, ssl_contexts)
from flotilla.runtime.pipeline.head import build_pipeline_engine
from flotilla.runtime.pipeline.messages import Ping
from flotilla.runtime.pipeline.peer import LinkSettings
from flotilla.runtime.pipeline.pipeline import PipelineSettings
from flotilla.runtime.pipeline.weight_push import stage_shards
from flotilla.runtime.sampling import SamplingParams

from conftest import make_hf_model, save_hf_model, tiny_config
from pipeline_helpers import TOKEN, ThreadWorker, checkpoint_per_layer, make_tls_files, wait_until

ARGS = EngineArgs(kv_cache_memory="4MiB", max_num_seqs=16)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(8)]
MIXED = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, repetition_penalty=1.3,
                        presence_penalty=0.4, logprobs=True, top_logprobs=3, ignore_eos=True) if i % 2 else GREEDY
         for i in range(8)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    hf = save_hf_model(make_hf_model(tiny_config("llama", vocab_size=256, max_position_embeddings=512,
                                                 num_hidden_layers=4)), d / "hf")
    return checkpoint_per_layer(hf, d / "ckpt")


@pytest.fixture(scope="module")
def local(ckpt):
    lm = load_model(ckpt, "cpu", "float16", with_tokenizer=False, progress=False)
    return lambda prompts, params: generate(build_engine(lm, ARGS), prompts, params)


def pipeline(ckpt, workers, layers=None, report=None, **kw):
    link = LinkSettings(TOKEN, kw.pop("ssl", None), kw.pop("connect_timeout", 10.0))
    settings = PipelineSettings(tuple(w.address for w in workers), link, tuple(layers) if layers else None,
                                dtype="float16", **kw)
    return build_pipeline_engine(ckpt, ARGS, settings, report or (lambda line: None), with_tokenizer=False)


@pytest.fixture(scope="module")
def ring(ckpt, tmp_path_factory):
    """Three workers with the model, one engine over them, shared by the tests that leave it whole."""
    workers = [ThreadWorker(tmp_path_factory.mktemp(f"cache{i}"), ckpt, handshake_timeout=1.0) for i in range(3)]
    lines: list[str] = []
    engine = pipeline(ckpt, workers, report=lines.append)
    yield engine, workers, lines
    engine.close()
    for w in workers:
        w.stop()


def outputs(engine, prompts, params):
    """Tokens and logprobs per request."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(f"o{id(prompts)}-{i}", p, sp)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(zip(o.new_token_ids, o.logprobs or [None] * len(o.new_token_ids)))
    return [got[f"o{id(prompts)}-{i}"] for i in range(len(prompts))]


def test_three_stages_equal_the_local_engine(ring, ckpt):
    engine, _, lines = ring
    assert "pipeline split (by free memory and speed probe):" in "\n".join(lines)
    assert sum(st.end - st.start for st in engine.executor.pipeline.stages) == 4
    lm = load_model(ckpt, "cpu", "float16", with_tokenizer=False, progress=False)
    got, want = outputs(engine, PROMPTS, MIXED), outputs(build_engine(lm, ARGS), PROMPTS, MIXED)
    assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want]
    for g, w in zip(got, want):
        assert [lp is None for _, lp in g] == [lp is None for _, lp in w]
        assert all(abs(a - b) < 1e-2 for (_, a), (_, b) in zip(g, w) if a is not None)
    stats = engine.executor.pipeline.worker_stats()
    assert stats[0].steps > 0 and stats[0].decode_tokens > 0
    assert stats[0].decode_bytes / stats[0].decode_tokens <= 64 * 2 + 256  # hidden_size x 2 + 256 per token



def test_logit_bias_and_min_tokens_cross_the_wire(ring, ckpt):
    """A request's logit bias and min_tokens (its end tokens masked) reach the last stage: the same
    tokens as the local engine, and no stop token before min_tokens."""
    engine, _, _ = ring
    lm = load_model(ckpt, "cpu", "float16", with_tokenizer=False, progress=False)
    free = outputs(build_engine(lm, ARGS), PROMPTS[:3], GREEDY)
    firsts = [seq[0][0] for seq in free]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias=((firsts[0], -100.0), (7, 5.0))),
              SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True, min_tokens=6,
                             stop_token_ids=(firsts[1],)),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, min_tokens=4, stop_token_ids=(firsts[2],))]
    got, want = outputs(engine, PROMPTS[:3], params), outputs(build_engine(lm, ARGS), PROMPTS[:3], params)
    assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want]
    assert got[0][0][0] != firsts[0]
    for seq, stop in zip(got[1:], firsts[1:]):
        tokens = [t for t, _ in seq]
        assert stop not in tokens[:-1] and (len(tokens) == 10 or (len(tokens) > 4 and tokens[-1] == stop))


def test_a_second_head_is_refused_while_the_first_is_heard(ring, ckpt):
    """A second `runtime serve` pointed at workers that serve a live head gets one clear error, and the
    first head's pipeline goes on untouched (it used to take the workers over, and the heads fought)."""
    from flotilla.errors import FlotillaError

    engine, workers, _ = ring
    with pytest.raises(FlotillaError, match="serves another head .* stop that head first"):
        pipeline(ckpt, workers)
    assert engine.executor.pipeline.ready.is_set() and not engine.executor.pipeline.problems()
    lm = load_model(ckpt, "cpu", "float16", with_tokenizer=False, progress=False)
    got, want = outputs(engine, PROMPTS[:2], MIXED), outputs(build_engine(lm, ARGS), PROMPTS[:2], MIXED)
    assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want]

def test_a_silent_head_is_replaced_and_then_refused(ckpt, tmp_path, monkeypatch):
    """A head silent for HEAD_QUIET (its host froze, or its link went down) loses its workers to a new
    head, which serves exactly; when the old head wakes, its repair is refused with the reason, kept
    in /health's problems, and the new head's pipeline goes on."""
    from flotilla.runtime.pipeline import worker as worker_module

    workers = [ThreadWorker(tmp_path / f"cache{i}", ckpt, handshake_timeout=1.0) for i in range(2)]
    old = new = None
    frozen, release = threading.Event(), threading.Event()
    try:
        old = pipeline(ckpt, workers)
        monkeypatch.setattr(worker_module, "HEAD_QUIET", 0.5)
        old.executor.pipeline._loop.call_soon_threadsafe(lambda: (frozen.set(), release.wait(60)))
        assert frozen.wait(10)
        time.sleep(0.8)  # no pings from the old head: it is now silent for longer than HEAD_QUIET
        new = pipeline(ckpt, workers)
        monkeypatch.setattr(worker_module, "HEAD_QUIET", 5.0)  # the new head is heard: it keeps the workers
        release.set()
        assert wait_until(lambda: any("serves another head" in p for p in old.executor.pipeline.problems()), 20), \
            old.executor.pipeline.problems()
        lm = load_model(ckpt, "cpu", "float16", with_tokenizer=False, progress=False)
        got, want = outputs(new, PROMPTS[:2], MIXED), outputs(build_engine(lm, ARGS), PROMPTS[:2], MIXED)
        assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want]
        assert new.executor.pipeline.ready.is_set() and not new.executor.pipeline.problems()
    finally:
        release.set()
        for e in (new, old):
            if e is not None:
                e.close()
        for w in workers:
            w.stop()

# ---------------------------------------------------------------------------------- hostile peers

async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the worker closed this connection (EOF) within a few seconds. A reset counts: a
    socket closed with bytes of ours still unread (the rest of a replay) sends RST, not FIN."""
    try:
        while await asyncio.wait_for(reader.read(65536), 5):
            pass
        return True
    except ConnectionResetError:
        return True
    except (ConnectionError, asyncio.TimeoutError):
        return False
    except OSError:
        return True


def _raw_frame(conn, body: bytes) -> bytes:
    """A frame with a valid MAC over `body` on an authenticated connection."""
    tag = _mac(conn._send_key, struct.pack(">Q", conn._send_seq), body)
    conn._send_seq += 1
    return frame(tag + body)


async def _attack(case: str, host: str, port: int) -> bool:
    if case == "wrong-token":
        reader, writer = await asyncio.open_connection(host, port)
        with pytest.raises((AuthError, ConnectionError, asyncio.IncompleteReadError)):
            await client_handshake(reader, writer, b"not-the-token-but-long-enough", "intruder", timeout=5)
        return True  # client_handshake closes on failure; the worker refused (checked by the counter)
    if case == "no-token-silent":
        reader, writer = await asyncio.open_connection(host, port)
        return await _closed(reader)  # the handshake times out
    if case == "no-token-step":
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(frame(msgpack.packb(["step", [1, 1, [1], [0], [1], 1, [True], [[1]], [], [], [5], None, None]])))
        return await _closed(reader)
    if case == "replayed-handshake":
        # An eavesdropper records a genuine head's session with a worker (a stand-in here) ...
        async def genuine_worker(r, w):
            conn, _ = await server_handshake(r, w, TOKEN, timeout=5)
            await conn.recv()
        observed = await asyncio.start_server(genuine_worker, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", observed.sockets[0].getsockname()[1])
        sent: list[bytes] = []
        write = writer.write
        writer.write = lambda data: (sent.append(data), write(data))[1]
        conn = await client_handshake(reader, writer, TOKEN, "head", timeout=5)
        await conn.send(Ping(1))
        conn.close()
        observed.close()
        # ... and replays every byte of it to this worker, whose nonce is fresh.
        r2, w2 = await asyncio.open_connection(host, port)
        for data in sent:
            w2.write(data)
        return await _closed(r2)
    if case == "oversized-before-auth":
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(struct.pack(">I", 100 << 20))
        return await _closed(reader)
    conn = await connect(host, port, TOKEN, "buggy", timeout=5)
    if case == "oversized-after-auth":
        conn.writer.write(struct.pack(">I", 200 << 20) + b"\0" * 64)
    elif case == "malformed-msgpack":
        conn.writer.write(_raw_frame(conn, b"\xc1\xc1\xc1 not msgpack"))
    elif case == "unknown-type":
        conn.writer.write(_raw_frame(conn, msgpack.packb(["drop_tables", [1, 2]])))
    elif case == "garbage-before-auth":
        pass
    return await _closed(conn.reader)


@pytest.mark.parametrize("case", ["wrong-token", "no-token-silent", "no-token-step", "replayed-handshake",
                                  "oversized-before-auth", "oversized-after-auth", "malformed-msgpack",
                                  "unknown-type"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_hostile_connection_is_closed_and_the_worker_serves_on(ring, local, case, stage):
    engine, workers, _ = ring
    worker = workers[stage]
    before, generation = worker.worker.rejected, engine.executor.generation
    want = local(PROMPTS[:3], GREEDY)
    result: dict = {}
    attacker = threading.Thread(target=lambda: result.update(closed=asyncio.run(_attack(case, *worker.address))))
    attacker.start()
    rounds = 0
    while attacker.is_alive() or rounds == 0:  # the head keeps generating while the attack goes on
        assert generate(engine, PROMPTS[:3], GREEDY) == want
        rounds += 1
    assert result["closed"]
    assert wait_until(lambda: worker.worker.rejected == before + 1, 5)
    assert generate(engine, PROMPTS[:3], GREEDY) == want
    assert engine.executor.generation == generation and not engine.problems()


# ---------------------------------------------------------------------------------- weight push

def test_a_worker_without_the_model_receives_exactly_its_shards_then_nothing(ckpt, local, tmp_path):
    cache = tmp_path / "empty-cache"
    w0 = ThreadWorker(tmp_path / "c0", ckpt)
    w1 = ThreadWorker(cache)  # no --model, nothing cached
    engine = pipeline(ckpt, [w0, w1], layers=(2, 2))
    try:
        manifest = Manifest.read(ckpt)
        config = engine.executor.pipeline.config
        mine = stage_shards(config, engine.executor.pipeline.stages[1], _weight_map(ckpt))
        assert mine == [manifest.layer_to_shard[k] for k in ("2", "3", "head")]
        expected = sum(manifest.shard(f).size for f in mine)
        peer = engine.executor.pipeline.peers[1]
        assert peer.pushed_bytes == expected == w1.worker.shard_bytes_received
        others = [manifest.layer_to_shard[k] for k in ("embed", "0", "1")]  # stage 0's: never sent
        assert expected + sum(manifest.shard(f).size for f in others) == sum(s.size for s in manifest.shards)
        assert engine.executor.pipeline.loaded[1].received_bytes == expected
        assert generate(engine, PROMPTS, GREEDY) == local(PROMPTS, GREEDY)
        port = w1.port
        w1.stop()  # restarted: its cache has everything, nothing is sent
        assert wait_until(lambda: not engine.executor.ready, 10)
        w1 = ThreadWorker(cache, port=port)
        assert wait_until(lambda: engine.executor.ready, 30), engine.problems()
        assert w1.worker.shard_bytes_received == 0 and peer.pushed_bytes == expected
        assert "its cache" in engine.executor.pipeline.loaded[1].source
        assert generate(engine, PROMPTS, GREEDY) == local(PROMPTS, GREEDY)
    finally:
        engine.close()
        w0.stop()
        w1.stop()


def _weight_map(ckpt):
    import json

    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]


# ---------------------------------------------------------------------------------- faults

@pytest.mark.parametrize("lost", [1, 2], ids=["middle", "last"])  # the last stage holds the result connection
def test_a_stage_lost_mid_generation_comes_back_and_the_tokens_are_undisturbed(ckpt, local, tmp_path, lost):
    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(3)]
    engine = pipeline(ckpt, workers, layers=(1, 2, 1))
    want = local(PROMPTS, MIXED)
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, MIXED)):
            engine.add_request(f"f{i}", p, sp)
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            steps += 1
            if steps == 8:
                port = workers[lost].port
                workers[lost].stop()
                workers[lost] = ThreadWorker(tmp_path / f"c{lost}", ckpt, port=port)
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert engine.num_rewinds == 1
        assert [got[f"f{i}"] for i in range(8)] == want
    finally:
        engine.close()
        for w in workers:
            w.stop()


def test_a_stage_that_stays_away_fails_its_requests_then_serves_again(ckpt, local, tmp_path):
    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt) for i in range(2)]
    engine = pipeline(ckpt, workers, layers=(2, 2), stage_timeout=0.5)
    try:
        for i in range(4):
            engine.add_request(f"t{i}", PROMPTS[i], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        port = workers[1].port
        workers[1].stop()
        start, ended = time.monotonic(), []
        while engine.has_unfinished() and time.monotonic() - start < 10:
            if not engine.executor.ready:
                problems = engine.problems()
            ended += [o for o in engine.step() if o.finished]
        assert sorted(o.request_id for o in ended) == ["t0", "t1", "t2", "t3"]
        assert all(f"pipeline stage 1 (127.0.0.1:{port}) is unreachable" in o.error for o in ended)
        assert problems and f"stage 1 (127.0.0.1:{port})" in problems[0]
        workers[1] = ThreadWorker(tmp_path / "c1", ckpt, port=port)
        assert wait_until(lambda: engine.executor.ready, 30), engine.problems()
        assert generate(engine, PROMPTS[:2], GREEDY) == local(PROMPTS[:2], GREEDY)
        assert engine.problems() == []
    finally:
        engine.close()
        for w in workers:
            w.stop()


# ---------------------------------------------------------------------------------- TLS

def test_tls_between_every_hop(ckpt, local, tmp_path):
    files = make_tls_files(tmp_path)
    if files is None:
        pytest.skip("the openssl command is not installed; it makes the test certificates")
    server, client = ssl_contexts(*map(str, files))
    from flotilla.errors import FlotillaError

    workers = [ThreadWorker(tmp_path / f"c{i}", ckpt, ssl_server=server, ssl_client=client) for i in range(2)]
    plain = ThreadWorker(tmp_path / "plain", ckpt)
    try:
        # one side with TLS, the other without: a line that says so, not a bare exception name
        with pytest.raises(FlotillaError, match="closed the connection without a word: a worker with TLS"):
            pipeline(ckpt, workers, layers=(2, 2), connect_timeout=3)
        with pytest.raises(FlotillaError, match="the TLS handshake failed .*a worker without TLS"):
            pipeline(ckpt, [plain, workers[1]], layers=(2, 2), ssl=client, connect_timeout=3)
        engine = pipeline(ckpt, workers, layers=(2, 2), ssl=client)
        assert generate(engine, PROMPTS, GREEDY) == local(PROMPTS, GREEDY)
        engine.close()
    finally:
        for w in [*workers, plain]:
            w.stop()


def test_a_tls_client_at_a_plain_port_is_named_in_the_frame_error():
    from flotilla.runtime.pipeline.wire import ProtocolError, read_frame

    async def first_frame(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, 4096)

    with pytest.raises(ProtocolError, match="a TLS handshake arrived on a plain connection"):
        asyncio.run(first_frame(bytes([0x16, 0x03, 0x01, 0x02, 0x00]) + b"x" * 10))


def test_nothing_listens_on_a_closed_worker_port(tmp_path, ckpt):
    w = ThreadWorker(tmp_path, ckpt)
    port = w.port
    w.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_a_head_of_another_protocol_version_is_told_the_workers(ckpt, tmp_path):
    """A worker answers a Hello of another version with its own version (in a challenge no proof can
    answer), so the head says "peer speaks protocol version N" instead of guessing at TLS."""
    from flotilla.runtime.pipeline.connection import Challenge, Hello
    from flotilla.runtime.pipeline.wire import PROTOCOL_VERSION, decode, encode, read_frame

    w = ThreadWorker(tmp_path, ckpt)

    async def hello_from_the_past():
        reader, writer = await asyncio.open_connection(*w.address)
        writer.write(frame(encode(Hello(PROTOCOL_VERSION - 1, b"n" * 32, "old head"))))
        await writer.drain()
        reply = decode(await asyncio.wait_for(read_frame(reader, 4096), 5))
        writer.close()
        return reply

    try:
        reply = asyncio.run(hello_from_the_past())
        assert isinstance(reply, Challenge) and reply.version == PROTOCOL_VERSION and reply.proof == b""
        assert wait_until(lambda: w.worker.rejected == 1, 5)
    finally:
        w.stop()
