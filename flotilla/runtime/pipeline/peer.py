"""The head's link to one worker: control requests, heartbeats, and what the worker sends back.

Control requests go one at a time (`call`, `load`); the worker answers them in order. Steps to
stage 0 share the connection. Everything that arrives is dispatched by one reader task: Pongs
mark the worker alive, StepResults and Faults go to the pipeline, the rest answer the pending
request. A closed connection or `heartbeat_timeout` seconds of silence (Pings go out every
`heartbeat_interval`) make the peer lost: its pending request fails and the pipeline hears of it.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flotilla.errors import FlotillaError

from .connection import AuthError, Connection, connect, format_address
from .messages import Failure, Fault, LoadStage, NeedFiles, Ping, Pong, StageLoaded, StepResult
from .weight_push import push_files
from .wire import DEFAULT_MAX_FRAME, ProtocolError

GONE = (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, asyncio.TimeoutError, AuthError,
        ProtocolError)


class RemoteFailure(FlotillaError):
    """A worker answered a request with Failure."""


class PeerLost(ConnectionError):
    """The connection to a worker ended while a request was pending."""


@dataclass(frozen=True)
class LinkSettings:
    token: bytes
    ssl: ssl.SSLContext | None = None
    connect_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    max_frame: int = DEFAULT_MAX_FRAME


class StagePeer:
    def __init__(self, index: int, host: str, port: int, settings: LinkSettings,
                 on_data: Callable[["StagePeer", object], None], on_lost: Callable[["StagePeer", str], None]):
        self.index, self.host, self.port = index, host, port
        self.settings = settings
        self._on_data, self._on_lost = on_data, on_lost
        self.conn: Connection | None = None
        self.last_seen = 0.0
        self.pushed_bytes = 0
        self._replies: asyncio.Queue = asyncio.Queue()
        self._rpc = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def connected(self) -> bool:
        return self.conn is not None

    async def connect(self) -> None:
        s = self.settings
        conn = await connect(self.host, self.port, s.token, "head", s.ssl, s.connect_timeout, s.max_frame)
        conn.allow_direct()
        self.conn, self.last_seen = conn, time.monotonic()
        self._replies = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._read(conn)), asyncio.create_task(self._heartbeat(conn))]

    async def call(self, msg, timeout: float | None = None):
        async with self._rpc:
            await self._send(msg)
            return await self._reply(timeout)

    async def load(self, req: LoadStage, model_dir: Path) -> StageLoaded:
        """LoadStage, pushing the shards the worker asks for."""
        async with self._rpc:
            await self._send(req)
            reply = await self._reply(None)
            if isinstance(reply, NeedFiles):
                self.pushed_bytes += await push_files(self.conn, model_dir, reply.files, req.shards)
                reply = await self._reply(None)
            if not isinstance(reply, StageLoaded):
                raise RemoteFailure(f"{self.address}: answered LoadStage with {reply.WIRE_NAME}")
            return reply

    def write(self, msg) -> None:
        """A data frame (a Step to stage 0), written now on the loop's thread; a lost connection
        is the reader's to report."""
        conn = self.conn
        if conn is None or conn.writer.is_closing():
            return
        try:
            conn.write(msg)
        except GONE:
            pass

    def write_direct(self, msg) -> bool:
        """A data frame written from the engine's thread, no hand-off (Connection.write_direct);
        False: write it on the loop's thread."""
        conn = self.conn
        try:
            return conn is not None and conn.write_direct(msg)
        except GONE:
            return True  # the reader reports the loss

    def backlogged(self) -> bool:
        """Whether data frames wait for the loop's thread (Connection.backlogged)."""
        conn = self.conn
        return conn is not None and conn.backlogged

    async def _send(self, msg) -> None:
        conn = self.conn
        if conn is None:
            raise PeerLost(f"{self.address} is not connected")
        await conn.send(msg)

    async def _reply(self, timeout: float | None):
        reply = await asyncio.wait_for(self._replies.get(), timeout)
        if isinstance(reply, PeerLost):
            raise reply
        if isinstance(reply, Failure):
            raise RemoteFailure(f"worker {self.address}: {reply.message}")
        return reply

    async def _read(self, conn: Connection) -> None:
        reason = "the connection closed"
        def handle(msg) -> None:  # in the connection's data callback, as each frame arrives
            self.last_seen = time.monotonic()
            if isinstance(msg, Pong):
                return
            if isinstance(msg, (StepResult, Fault)):
                self._on_data(self, msg)
            else:
                self._replies.put_nowait(msg)

        try:
            await conn.serve(handle)
        except asyncio.CancelledError:
            raise
        except GONE as e:
            if isinstance(e, asyncio.IncompleteReadError) and not e.partial:  # EOF between frames
                reason = "the worker closed the connection (it was stopped, or its process ended)"
            else:
                reason = f"the connection closed ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
        self.drop(conn, reason)

    async def _heartbeat(self, conn: Connection) -> None:
        s, nonce = self.settings, 0
        while True:
            await asyncio.sleep(s.heartbeat_interval)
            silent = time.monotonic() - self.last_seen
            if silent > s.heartbeat_timeout:
                self.drop(conn, f"no heartbeat for {silent:.0f}s")
                return
            nonce += 1
            try:
                await conn.send(Ping(nonce))
            except GONE:
                pass  # the reader sees the end

    def ping(self) -> None:
        """A Ping now, out of the heartbeat's turn (the pipeline asks who is alive after a fault);
        the Pong moves `last_seen`."""
        conn = self.conn
        if conn is not None and not conn.writer.is_closing():
            try:
                conn.write(Ping(0))
            except GONE:
                pass  # the reader sees the end

    def drop(self, conn: Connection | None = None, reason: str = "closed by the head") -> None:
        """Close the connection (if `conn` is still the current one) and report the loss."""
        conn = conn or self.conn
        if conn is None or conn is not self.conn:
            return
        self.conn = None
        conn.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._replies.put_nowait(PeerLost(f"worker {self.address}: {reason}"))
        self._on_lost(self, reason)

    def close(self) -> None:
        conn, self.conn = self.conn, None
        for task in self._tasks:
            task.cancel()
        if conn is not None:
            conn.close()
