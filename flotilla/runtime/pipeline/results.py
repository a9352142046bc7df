"""The head's result channel: the last stage's StepResults, read on the engine's own thread.

The engine's thread writes each step to stage 0's socket itself (Connection.write_direct); this is
the ring's other end. For each epoch the head opens one more connection to the last stage,
authenticated as every connection is, whose first frame is `ResultsLink(epoch)`; the worker
answers `Configured(epoch)` on it and from then on sends that epoch's StepResults there and only
there. The engine's thread reads it with plain socket calls, so a result goes from the socket to
the engine with no event loop, no other thread and no queue in between; the head's I/O thread
keeps the control connections (heartbeats, faults, loads).

`spin`: seconds the reader polls the socket (non-blocking reads) before it sleeps in poll(2),
while it waits for a micro-batch in flight. A sleeping thread's wake-up, an idle core's under a
hypervisor above all, can cost more than the hop's own work; polling costs a core while steps are
in flight. 0: sleep at once. It polls only while `may_spin()`: the polling thread holds the GIL
between its reads, so the head's I/O thread, when it has frames to write, gets it only at the
interpreter's switch interval (5 ms); the reader sleeps instead then.

A channel that breaks (the stream ends, a bad frame) says so once through `on_lost` and then
returns nothing; `abort` (from another thread) ends it without a word.
"""
from __future__ import annotations

import hmac
import select
import socket
import ssl
import time
from typing import Callable

from .connection import HANDSHAKE_MAX_FRAME, TAG_BYTES, AuthError, Challenge, ClientHandshake, frame_tag, read_plain
from .messages import Configured, ResultsLink, StepResult
from .wire import FRAME_HEADER, ProtocolError, decode, encode

_HEADER = FRAME_HEADER.size
_READ = 1 << 16


class ResultChannel:
    def __init__(self, sock: socket.socket, recv_key: bytes, peer: str, max_frame: int, spin: float,
                 on_lost: Callable[["ResultChannel", str], None], may_spin: Callable[[], bool] = lambda: True):
        self._sock = sock
        sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._mac = hmac.new(recv_key, digestmod="sha256")
        self._seq = 0  # the next frame's sequence number
        self._buf = bytearray()
        self.peer, self.max_frame, self.spin = peer, max_frame, spin
        self._on_lost = on_lost
        self._may_spin = may_spin
        self._ended = False

    def read(self, timeout: float) -> list[StepResult]:
        """The results that have come, waiting up to `timeout` seconds for the first."""
        if self._ended:
            self._sock.close()
            return []
        try:
            out = self._messages(StepResult)
            if not out and self._wait(timeout):
                out = self._messages(StepResult)
            return out
        except (OSError, ProtocolError) as e:
            if not self._ended:
                self._ended = True
                self._on_lost(self, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return []

    def abort(self) -> None:
        """End the channel from any thread: a reader blocked in it returns (shutdown wakes poll)."""
        self._ended = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        self._sock.close()

    def _wait(self, timeout: float) -> bool:
        """Read what arrives within `timeout` (polling for up to `spin` of it first); False if nothing did."""
        if self._recv():
            return True
        if timeout <= 0:
            return False
        now = time.monotonic()
        deadline = now + timeout
        spin_end = min(deadline, now + self.spin)
        while now < spin_end and self._may_spin():
            if self._recv():
                return True
            now = time.monotonic()
        while now < deadline:
            if self._poll.poll(max(1, int((deadline - now) * 1000))) and self._recv():
                return True
            if self._ended:
                return False
            now = time.monotonic()
        return False

    def _recv(self) -> bool:
        try:
            data = self._sock.recv(_READ)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return False
        if not data:
            if self._ended:
                return False
            raise ConnectionError(f"the last stage ({self.peer}) closed the result connection")
        self._buf += data
        while isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            self._buf += self._sock.recv(self._sock.pending())
        return True

    def confirm(self, epoch: int, timeout: float) -> None:
        """Wait for the worker's Configured(epoch), the connection's first frame."""
        deadline = time.monotonic() + timeout
        while not (got := self._messages(Configured)):
            if time.monotonic() > deadline or not self._wait(deadline - time.monotonic()):
                raise ProtocolError(f"the last stage ({self.peer}) did not confirm the result link in {timeout:g} s")
        if got[0].epoch != epoch or len(got) > 1:
            raise ProtocolError(f"the last stage ({self.peer}) confirmed the result link of epoch {got[0].epoch}, "
                                f"not {epoch}")

    def _messages(self, expected: type) -> list:
        """Every complete frame in the buffer, checked (size, MAC, type) and decoded."""
        out, buf = [], self._buf
        while len(buf) >= _HEADER:
            (n,) = FRAME_HEADER.unpack_from(buf)
            if n > self.max_frame + TAG_BYTES:
                raise ProtocolError(f"frame of {n} bytes exceeds the limit of {self.max_frame + TAG_BYTES}")
            if len(buf) < _HEADER + n:
                break
            with memoryview(buf) as view:
                tag, payload = bytes(view[_HEADER:_HEADER + TAG_BYTES]), bytes(view[_HEADER + TAG_BYTES:_HEADER + n])
            del buf[:_HEADER + n]
            if not hmac.compare_digest(tag, frame_tag(self._mac, self._seq, payload)):
                raise AuthError(f"frame from {self.peer} failed its integrity check")
            self._seq += 1
            msg = decode(payload, self.max_frame)
            if not isinstance(msg, expected):
                raise ProtocolError(f"unexpected {msg.WIRE_NAME} on the result connection")
            out.append(msg)
        return out


def open_result_channel(host: str, port: int, token: bytes, ssl_context: ssl.SSLContext | None, timeout: float,
                        max_frame: int, epoch: int, spin: float, on_lost: Callable[[ResultChannel, str], None],
                        may_spin: Callable[[], bool] = lambda: True) -> ResultChannel:
    """Connect to the last stage (blocking; call it off the event loop), authenticate, ask for
    `epoch`'s results and wait for the worker to confirm."""
    sock = socket.create_connection((host, port), timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        hs = ClientHandshake(token, "head-results")
        sock.sendall(hs.hello)
        proof, send_key, recv_key = hs.answer(read_plain(_read_frame(sock, HANDSHAKE_MAX_FRAME), Challenge))
        sock.sendall(proof)
        body = encode(ResultsLink(epoch))  # the only frame the head sends on it: sequence number 0
        tag = frame_tag(hmac.new(send_key, digestmod="sha256"), 0, body)
        sock.sendall(FRAME_HEADER.pack(TAG_BYTES + len(body)) + tag + body)
        channel = ResultChannel(sock, recv_key, f"{host}:{port}", max_frame, spin, on_lost, may_spin)
        channel.confirm(epoch, timeout)
    except BaseException:
        sock.close()
        raise
    return channel


def _read_frame(sock: socket.socket, max_frame: int) -> bytes:
    """One handshake frame's body, from a blocking socket."""
    (n,) = FRAME_HEADER.unpack(_exactly(sock, _HEADER))
    if n > max_frame:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    return _exactly(sock, n)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the result link's handshake")
        data += chunk
    return bytes(data)
