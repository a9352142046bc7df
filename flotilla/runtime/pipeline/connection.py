"""Authenticated connections between the head and pipeline workers.

Handshake (mutual HMAC-SHA256 challenge-response over the shared token, fresh nonces each side):

    client -> server   Hello(version, nonce_c, name)
    server -> client   Challenge(version, nonce_s, HMAC(token, "server" | nonce_c | nonce_s))
    client -> server   Proof(HMAC(token, "client" | nonce_c | nonce_s))

Each side checks the other's proof with a constant-time compare and drops the connection
silently on a mismatch, so a peer without the token learns nothing and can send nothing. A
replayed handshake fails: the other side's nonce is fresh. Afterwards every frame carries a tag
HMAC(direction key, sequence number | body), with keys derived from the token and both nonces,
so frames cannot be injected, reordered or replayed within or across connections.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import ssl
import struct
import threading

from .stream import FrameReader, open_connection
from .wire import (DEFAULT_MAX_FRAME, FRAME_HEADER, PROTOCOL_VERSION, ProtocolError, decode, encode, frame, message,
                   read_frame)

NONCE_BYTES = 32
TAG_BYTES = 32
HANDSHAKE_MAX_FRAME = 4096
MIN_TOKEN_LENGTH = 16
STREAM_LIMIT = 4 << 20  # asyncio's read buffer: large frames arrive in fewer pauses
_SEQ = struct.Struct(">Q")  # a frame's sequence number, under its MAC
DIRECT_MAX_FRAME = 256 << 10  # `write_direct` sends frames up to this size itself (a decode step's are far smaller)


TOKEN_MISMATCH = "the peer does not know the token"


class AuthError(ProtocolError):
    """The peer failed the handshake (wrong token, replay, wrong protocol version)."""


@message("hello")
class Hello:
    version: int
    nonce: bytes
    name: str


@message("challenge")
class Challenge:
    version: int
    nonce: bytes
    proof: bytes


@message("proof")
class Proof:
    proof: bytes


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def frame_tag(keyed, seq: int, body: bytes) -> bytes:
    """HMAC(key, seq | body), from an HMAC state already keyed with `key`."""
    h = keyed.copy()
    h.update(_SEQ.pack(seq))
    h.update(b"|")
    h.update(body)
    return h.digest()


def check_token(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    if len(raw) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the pipeline token must be at least {MIN_TOKEN_LENGTH} characters")
    return raw


class Connection:
    """One authenticated, framed, ordered channel. send()/recv() carry registered messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send_key: bytes,
                 recv_key: bytes, peer: str, max_frame: int = DEFAULT_MAX_FRAME):
        self.reader, self.writer = reader, writer
        self._send_key, self._recv_key = send_key, recv_key
        # HMAC states keyed once; each frame's tag continues a copy (same tag as _mac(key, seq, body))
        self._send_mac = hmac.new(send_key, digestmod="sha256")
        self._recv_mac = hmac.new(recv_key, digestmod="sha256")
        self._send_seq = self._recv_seq = 0
        self.peer = peer
        self.max_frame = max_frame
        self.bytes_sent = self.bytes_received = 0
        self._send_lock = asyncio.Lock()
        self._write_lock = threading.Lock()  # the loop's writes and `write_direct`'s: whole frames, in sequence
        self._direct: socket.socket | None = None  # see `allow_direct`
        self._pending: list[bytes] = []  # what `write_direct` left for the loop's thread, in sequence

    def write(self, msg) -> int:
        """Frame `msg` and hand it to the transport now, in one write (the loop's thread only;
        no await, so frames from any caller stay whole and in sequence). Returns its bytes. The
        transport sends at once when its buffer is empty and keeps the rest; `send` also waits
        for the buffer to drain (flow control for bulk data such as a weight push)."""
        body = encode(msg)
        with self._write_lock:
            self._write_pending()  # frames `write_direct` left go first
            data = self._seal(body)
            self.writer.write(data)
        return len(data)

    def _seal(self, body: bytes) -> bytes:
        """The next frame: length, MAC under the next sequence number, body (the write lock held)."""
        tag = frame_tag(self._send_mac, self._send_seq, body)
        self._send_seq += 1
        self.bytes_sent += FRAME_HEADER.size + TAG_BYTES + len(body)
        return b"".join((FRAME_HEADER.pack(TAG_BYTES + len(body)), tag, body))

    def allow_direct(self) -> None:
        """Let `write_direct` send from other threads (on the loop's thread; plain TCP only: a TLS
        stream's records are the transport's). It writes through a duplicate of the socket's
        descriptor, closed with the connection."""
        sock = self.writer.get_extra_info("socket")
        if self.writer.get_extra_info("sslcontext") is None and sock is not None and self._direct is None:
            self._loop = asyncio.get_running_loop()
            self._direct = socket.socket(fileno=os.dup(sock.fileno()))
            self._direct.setblocking(False)

    def write_direct(self, msg) -> bool:
        """From another thread (the head's engine thread): frame `msg` and send it on the socket
        now, with no hand-off to the loop's thread, when nothing is waiting to go before it (in
        the transport or here) and it is small. What the socket does not take at once, or what
        cannot go yet, waits here, in sequence, and the loop's thread writes it before anything
        else. False (nothing done) when direct writes are not allowed: write on the loop's thread."""
        direct = self._direct
        if direct is None:
            return False
        body = encode(msg)
        with self._write_lock:
            if self._direct is None or self.writer.is_closing():
                return True  # the connection is gone: its reader reports it
            data = self._seal(body)
            sent = 0
            transport = self.writer.transport
            if not self._pending and len(data) <= DIRECT_MAX_FRAME and not transport.get_write_buffer_size():
                try:
                    sent = direct.send(data)
                except BlockingIOError:
                    pass
                except OSError:
                    return True
            if sent < len(data):
                if not self._pending:
                    self._loop.call_soon_threadsafe(self._flush_pending)
                self._pending.append(data[sent:])
        return True

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for the loop's thread to write them (any thread may ask)."""
        return bool(self._pending) or bool(self.writer.transport.get_write_buffer_size())

    def _flush_pending(self) -> None:
        with self._write_lock:
            self._write_pending()

    def _write_pending(self) -> None:
        """On the loop's thread, the write lock held: what `write_direct` left, in sequence."""
        pending, self._pending = self._pending, []
        for data in pending:
            if not self.writer.is_closing():
                self.writer.write(data)

    async def send(self, msg) -> None:
        async with self._send_lock:
            self.write(msg)
            await self.writer.drain()

    async def recv(self):
        return self._open(await read_frame(self.reader, self.max_frame + TAG_BYTES))

    async def serve(self, handle) -> None:
        """Hand every message to `handle(msg)` as its frame arrives: in the transport's data
        callback on the loop's thread, with no task woken per frame (stream.py). Never returns:
        raises at the end of the connection (IncompleteReadError, the transport's error), for a
        bad frame (ProtocolError, AuthError) and with whatever `handle` raised."""
        if not isinstance(self.reader, FrameReader):  # a plain StreamReader: a task reads
            while True:
                handle(await self.recv())
        done = self.reader.dispatch(lambda body: handle(self._open(body)), self.max_frame + TAG_BYTES)
        try:
            await done
        finally:
            self.reader.stop()

    def _open(self, body: bytes):
        """Check a frame's MAC and decode its message."""
        self.bytes_received += len(body) + 4
        tag, payload = body[:TAG_BYTES], body[TAG_BYTES:]
        expected = frame_tag(self._recv_mac, self._recv_seq, payload)
        if not hmac.compare_digest(tag, expected):
            raise AuthError(f"frame from {self.peer} failed its integrity check")
        self._recv_seq += 1
        return decode(payload, self.max_frame)

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
        with self._write_lock:
            direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    async def wait_closed(self) -> None:
        self.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def _session_keys(token: bytes, nonce_c: bytes, nonce_s: bytes) -> tuple[bytes, bytes]:
    return _mac(token, b"c2s", nonce_c, nonce_s), _mac(token, b"s2c", nonce_c, nonce_s)


async def _read_plain(reader: asyncio.StreamReader, expected: type):
    return read_plain(await read_frame(reader, HANDSHAKE_MAX_FRAME), expected)


class ClientHandshake:
    """The client's side of the handshake, without I/O: `hello` to send, then `answer(challenge)`
    gives the proof to send and the session keys (client -> server, server -> client)."""

    def __init__(self, token: bytes, name: str):
        self.token, self.nonce = token, os.urandom(NONCE_BYTES)
        self.hello = frame(encode(Hello(PROTOCOL_VERSION, self.nonce, name)))

    def answer(self, ch: Challenge) -> tuple[bytes, bytes, bytes]:
        if ch.version != PROTOCOL_VERSION:
            raise AuthError(f"peer speaks protocol version {ch.version}, this flotilla speaks {PROTOCOL_VERSION}")
        if len(ch.nonce) != NONCE_BYTES or not hmac.compare_digest(ch.proof, _mac(self.token, b"server", self.nonce,
                                                                                     ch.nonce)):
            raise AuthError(TOKEN_MISMATCH)
        proof = frame(encode(Proof(_mac(self.token, b"client", self.nonce, ch.nonce))))
        return (proof, *_session_keys(self.token, self.nonce, ch.nonce))


def read_plain(body: bytes, expected: type):
    """A handshake frame's message, which must be an `expected`."""
    msg = decode(body, HANDSHAKE_MAX_FRAME)
    if not isinstance(msg, expected):
        raise AuthError(f"expected {expected.WIRE_NAME} during the handshake, got {msg.WIRE_NAME}")
    return msg


async def client_handshake(reader, writer, token: bytes, name: str, timeout: float = 10.0,
                           max_frame: int = DEFAULT_MAX_FRAME) -> Connection:
    async def run() -> Connection:
        hs = ClientHandshake(token, name)
        writer.write(hs.hello)
        await writer.drain()
        proof, c2s, s2c = hs.answer(await _read_plain(reader, Challenge))
        writer.write(proof)
        await writer.drain()
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        return Connection(reader, writer, c2s, s2c, peer, max_frame)

    return await _closing_on_failure(writer, asyncio.wait_for(run(), timeout))


async def server_handshake(reader, writer, token: bytes, timeout: float = 10.0,
                           max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Connection, str]:
    """Authenticate an incoming connection; returns it and the client's name."""
    async def run():
        hello = await _read_plain(reader, Hello)
        if hello.version != PROTOCOL_VERSION:  # our version in a challenge no proof can answer: the client says why
            writer.write(frame(encode(Challenge(PROTOCOL_VERSION, os.urandom(NONCE_BYTES), b""))))
            await writer.drain()
            raise AuthError(f"peer speaks protocol version {hello.version}, this flotilla speaks {PROTOCOL_VERSION}")
        if len(hello.nonce) != NONCE_BYTES:
            raise AuthError("bad nonce")
        nonce_s = os.urandom(NONCE_BYTES)
        writer.write(frame(encode(Challenge(PROTOCOL_VERSION, nonce_s, _mac(token, b"server", hello.nonce, nonce_s)))))
        await writer.drain()
        try:
            proof = await _read_plain(reader, Proof)
        except asyncio.IncompleteReadError:  # a client whose token differs leaves once it checked our proof
            raise AuthError("the client left after this worker's challenge: its token is likely not this "
                            "worker's (give both the same FLOTILLA_TOKEN or --token-file)") from None
        if not hmac.compare_digest(proof.proof, _mac(token, b"client", hello.nonce, nonce_s)):
            raise AuthError(TOKEN_MISMATCH)
        c2s, s2c = _session_keys(token, hello.nonce, nonce_s)
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        return Connection(reader, writer, s2c, c2s, peer, max_frame), hello.name[:64]

    return await _closing_on_failure(writer, asyncio.wait_for(run(), timeout))


async def _closing_on_failure(writer: asyncio.StreamWriter, handshake):
    """Run a handshake; on any failure drop the connection without a word, then re-raise."""
    try:
        return await handshake
    except BaseException:
        writer.close()
        raise


class TLSHandshakeError(ConnectionError):
    """The TLS handshake itself failed (before any flotilla frame): a peer without TLS, or certificates
    that do not match."""


async def connect(host: str, port: int, token: bytes, name: str, ssl_context: ssl.SSLContext | None = None,
                  timeout: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME) -> Connection:
    """Open a TCP (or TLS) connection and authenticate as a client."""
    try:
        reader, writer = await asyncio.wait_for(open_connection(host, port, STREAM_LIMIT, ssl_context), timeout)
    except (ssl.SSLError, ConnectionResetError, asyncio.IncompleteReadError) as e:
        if ssl_context is None:
            raise
        raise TLSHandshakeError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    return await client_handshake(reader, writer, token, name, timeout, max_frame)


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int]:
    """'host:port', '[v6]:port' or (with a default port) 'host' -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
        if ":" in text and not _is_ipv6(text):  # bad:host:x is a typo, not an IPv6 address
            raise ValueError(f"{text!r} is not HOST:PORT (an IPv6 address goes in brackets: [::1]:7070)")
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _is_ipv6(text: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ssl_contexts(cert: str | None, key: str | None, ca: str | None) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server context, client context) for optional TLS; (None, None) when no cert is given.

    With a CA, each side verifies the other's certificate against it (mutual TLS)."""
    if not cert:
        return None, None
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    client.load_cert_chain(cert, key)
    if ca:
        server.load_verify_locations(ca)
        server.verify_mode = ssl.CERT_REQUIRED
        client.check_hostname = False  # workers are addressed by IP on a LAN; the CA pins identity
    else:
        client.check_hostname = False
        client.verify_mode = ssl.CERT_NONE  # encryption only; the token handshake authenticates
    return server, client
