"""Frames to one peer, in order, written at once from the loop's thread."""
from __future__ import annotations

import asyncio
import ssl

from .connection import Connection

GONE = (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, asyncio.TimeoutError)


class Outbox:
    """Frames to one peer, in order. `put` (on the loop's thread; other threads go through
    `call_soon_threadsafe`) writes the frame to the transport right away: no queue and no task
    between a computed step and its socket. What the socket does not take at once waits in the
    transport's buffer, which the pipeline's depth bounds (at most one frame per micro-batch in
    flight). A connection that is gone is closed; its reader reports the loss."""

    def __init__(self, conn: Connection, on_sent=None):
        self.conn = conn
        self._on_sent = on_sent

    def put(self, msg) -> None:
        if self.conn.writer.is_closing():
            return
        try:
            nbytes = self.conn.write(msg)
        except GONE:
            self.conn.close()
            return
        if self._on_sent is not None:
            self._on_sent(msg, nbytes)

    def close(self) -> None:
        self.conn.close()
