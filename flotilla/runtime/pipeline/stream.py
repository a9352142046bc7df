"""Streams whose frames can be dispatched as they arrive, without a reader task.

An asyncio StreamReader wakes a task for every read: the transport's data callback resolves a
future, the loop schedules the task, the task runs on the next turn of the loop. For the
pipeline's steps that wake-up is much of a hop's cost. `FrameReader` is a StreamReader (the
handshake and the occasional single `recv` use it as one) that can also be switched to dispatch
mode (`dispatch`): then the transport's data callback itself cuts complete length-prefixed
frames (wire.py's framing) out of the buffer and hands each body to a function, in order, on
the loop's thread. The end of the stream, an oversized frame, or an exception from that
function ends dispatch and resolves the future `dispatch` returned.

`open_connection` and `start_server` are asyncio's, with a FrameReader as the reader.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Callable

from .wire import FRAME_HEADER, ProtocolError

_HEADER = FRAME_HEADER.size


class FrameReader(asyncio.StreamReader):
    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop):
        super().__init__(limit=limit, loop=loop)
        self._handle: Callable[[bytes], None] | None = None
        self._max_frame = 0
        self._done: asyncio.Future | None = None

    def dispatch(self, handle: Callable[[bytes], None], max_frame: int) -> asyncio.Future:
        """From now on, hand every frame's body to `handle` as it arrives. Returns a future that
        fails when dispatch ends: IncompleteReadError at the end of the stream, the transport's
        error, ProtocolError for a frame over `max_frame`, or whatever `handle` raised."""
        if self._handle is not None:
            raise RuntimeError("this stream already dispatches its frames")
        self._handle, self._max_frame = handle, max_frame
        self._done = self._loop.create_future()
        if self._exception is not None:
            self._end(self._exception)
        else:
            self._cut()  # frames that came with (or after) the last one read
            if self._eof:
                self.feed_eof()
        if self._paused and self._handle is not None:  # the buffer is cut down: read on
            self._paused = False
            self._transport.resume_reading()
        return self._done

    def feed_data(self, data) -> None:
        if self._handle is None:
            super().feed_data(data)
            return
        if not data:
            return
        if not self._buffer and len(data) >= _HEADER:  # the usual case: exactly one whole frame
            (n,) = FRAME_HEADER.unpack_from(data)
            if len(data) == _HEADER + n and n <= self._max_frame:
                self._call(data[_HEADER:])
                return
        self._buffer += data
        self._cut()

    def feed_eof(self) -> None:
        super().feed_eof()
        if self._handle is not None:
            self._end(asyncio.IncompleteReadError(bytes(self._buffer), None))

    def set_exception(self, exc) -> None:
        super().set_exception(exc)
        if self._handle is not None:
            self._end(exc)

    def _cut(self) -> None:
        """Hand out every complete frame in the buffer (one slice and one delete per frame)."""
        buf = self._buffer
        while self._handle is not None and len(buf) >= _HEADER:
            (n,) = FRAME_HEADER.unpack_from(buf)
            if n > self._max_frame:
                self._end(ProtocolError(f"frame of {n} bytes exceeds the limit of {self._max_frame}"))
                return
            if len(buf) < _HEADER + n:
                return
            with memoryview(buf) as view:
                body = bytes(view[_HEADER:_HEADER + n])
            del buf[:_HEADER + n]
            self._call(body)

    def _call(self, body: bytes) -> None:
        try:
            self._handle(body)
        except Exception as e:  # noqa: BLE001 - ends dispatch; the awaiting side raises it
            self._end(e)

    def stop(self) -> None:
        """End dispatch (the awaiting side was cancelled); later data is buffered again."""
        self._handle = None

    def _end(self, exc: BaseException) -> None:
        self._handle = None
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)


async def open_connection(host: str, port: int, limit: int, ssl_context: ssl.SSLContext | None = None):
    """asyncio.open_connection with a FrameReader."""
    loop = asyncio.get_running_loop()
    reader = FrameReader(limit, loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, port, ssl=ssl_context)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def start_server(client_connected, host: str | None, port: int | None, limit: int,
                       ssl_context: ssl.SSLContext | None = None, sock: socket.socket | None = None
                       ) -> asyncio.AbstractServer:
    """asyncio.start_server with a FrameReader for every connection; on `sock` (a listening socket
    already bound) instead of host and port where given."""
    loop = asyncio.get_running_loop()

    def factory():
        return asyncio.StreamReaderProtocol(FrameReader(limit, loop), client_connected, loop=loop)

    if sock is not None:
        return await loop.create_server(factory, sock=sock, ssl=ssl_context)
    return await loop.create_server(factory, host, port, ssl=ssl_context)
