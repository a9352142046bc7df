"""Frames to one peer, in order, from any thread."""
from __future__ import annotations

import asyncio
import ssl

from .connection import Connection

GONE = (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, asyncio.TimeoutError)


class Outbox:
    """Frames to one peer, sent in order by one task (any thread may `put` via the loop)."""

    def __init__(self, conn: Connection, on_sent=None):
        self.conn = conn
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_sent = on_sent
        self._task = asyncio.create_task(self._run())

    def put(self, msg) -> None:
        self._queue.put_nowait(msg)

    async def _run(self) -> None:
        try:
            while True:
                msg = await self._queue.get()
                before = self.conn.bytes_sent
                await self.conn.send(msg)
                if self._on_sent is not None:
                    self._on_sent(msg, self.conn.bytes_sent - before)
        except GONE:
            self.conn.close()

    def close(self) -> None:
        self._task.cancel()
        self.conn.close()
