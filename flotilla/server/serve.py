"""Run the server until SIGTERM/SIGINT, then drain: stop accepting, give in-flight requests the
grace period to finish, cancel what is left, close the websockets, stop the engine.

The grace period ends early where waiting cannot help: while the engine reports a problem (a
pipeline stage is down: the requests would only wait for it), or at a second signal."""
from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import Callable

from aiohttp import web

from flotilla.errors import FlotillaError
from flotilla.progress import say_line

from .app import build_app
from .listen import prepare_to_listen
from .state import ServerState


def display_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else (
        f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}"


class Server:
    """`sockets`: already bound sockets to serve on (listen.bind_sockets); without them the server
    binds the config's host and port when it starts."""

    def __init__(self, state: ServerState, manage_engine: bool = True, sockets: list[socket.socket] | None = None):
        self.state = state
        self.app = build_app(state, manage_engine)
        # keepalive_timeout: aiohttp closes a kept-alive connection that has waited this long for the next
        # request's headers (never one whose request is running: a stream, a websocket); a new connection that
        # brings none is closed by _close_if_idle (aiohttp does so itself only since late 2026)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                                    keepalive_timeout=state.config.idle_timeout)
        self.sockets = sockets or []
        self.port: int | None = None

    @property
    def url(self) -> str:
        return display_url(self.state.config.host, self.port)

    async def start(self) -> None:
        cfg = self.state.config
        await self.runner.setup()
        self._watch_first_requests()
        prepare_to_listen(self.sockets)
        sites = [web.SockSite(self.runner, sock) for sock in self.sockets] or [
            web.TCPSite(self.runner, cfg.host, cfg.port, reuse_address=True)]
        try:
            for site in sites:
                await site.start()
        except OSError as e:
            await self.runner.cleanup()
            raise FlotillaError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
        self.port = self.runner.addresses[0][1]

    def _watch_first_requests(self) -> None:
        """Each new connection that has brought no request (its headers never ended, or it sent nothing) when
        idle_timeout passes is closed: aiohttp's keepalive timer covers the time between requests, and only its
        recent releases the time before the first."""
        server, requested, idle = self.runner.server, self.state.requested, self.state.config.idle_timeout
        made, lost = server.connection_made, server.connection_lost
        loop = asyncio.get_running_loop()
        open_: dict = {}  # handler -> its transport, while the connection is open

        def close_if_idle(transport) -> None:
            if id(transport) not in requested and not transport.is_closing():
                transport.close()

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            open_[handler] = transport
            loop.call_later(idle, close_if_idle, transport)

        def connection_lost(handler, exc=None) -> None:
            transport = open_.pop(handler, None)
            if transport is not None:
                requested.discard(id(transport))  # (an id may be reused once the transport is gone)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost

    async def drain(self) -> None:
        await self.stop_accepting()
        await self.finish()

    async def stop_accepting(self) -> None:
        self.state.admission.draining = True  # open connections get 503 for new requests
        for site in list(self.runner.sites):
            await site.stop()  # closes the listening socket: no new connections

    async def finish(self, cut_short: asyncio.Event | None = None) -> None:
        """In-flight requests get the grace period, less while the engine has a problem (they could
        not finish) or once `cut_short` is set; then the rest are cancelled and all is closed."""
        admission = self.state.admission
        if not await self._wait_idle(self.state.config.grace_period, cut_short):
            await self.state.engine.abort_all()
            await admission.wait_idle(5.0)
        await self.runner.cleanup()

    async def _wait_idle(self, timeout: float, cut_short: asyncio.Event | None) -> bool:
        admission, engine = self.state.admission, self.state.engine
        deadline = asyncio.get_running_loop().time() + timeout
        down_since = None  # when the engine's problems began (a pipeline stage down), if it has any now
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if await admission.wait_idle(max(0.0, min(left, GRACE_POLL_S))):
                return True
            if left <= GRACE_POLL_S:
                return False
            if cut_short is not None and cut_short.is_set():
                _announce("flotilla: second signal: cancelling the in-flight requests now")
                return False
            problems = engine.problems()
            now = asyncio.get_running_loop().time()
            down_since = (down_since if down_since is not None else now) if problems else None
            if problems and now - down_since >= DOWN_GRACE_S:  # not a short repair (a broken link, a local restart)
                _announce(f"flotilla: cancelling the {admission.in_flight} in-flight requests now, not after the "
                          f"grace period: they cannot finish ({'; '.join(problems)})")
                return False


async def serve(state: ServerState, announce: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None, sockets: list[socket.socket] | None = None) -> None:
    server = Server(state, sockets=sockets)
    await server.start()
    quiet_accept_errors(asyncio.get_running_loop(), state.config.idle_timeout)
    (announce or _announce)(f"flotilla: serving '{state.engine.model_name}' — OpenAI API at {server.url}/v1\n"
                            f"flotilla: chat page: {server.url}/")
    stop = stop or asyncio.Event()
    again = asyncio.Event()  # a second signal: no more grace
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: again.set() if stop.is_set() else stop.set())
    dead: list[str] = []
    watcher = asyncio.create_task(_watch_engine(state, stop, dead))
    try:
        await stop.wait()
        await server.stop_accepting()
        if not dead and state.admission.in_flight:
            _announce(f"flotilla: shutting down: no new connections; in-flight requests get "
                      f"{state.config.grace_period:g}s to finish (a second Ctrl-C cancels them now)")
        elif not dead:
            _announce("flotilla: shutting down")
        await server.finish(again)
    finally:
        watcher.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if dead:
        raise EngineDied("; ".join(dead))


class EngineDied(FlotillaError):
    """The engine can never serve again: the server exits (status 1 from `runtime serve`), as vLLM's does, so
    that a supervisor restarts it and a load balancer stops sending it requests."""


GRACE_POLL_S = 0.25  # how often the grace period asks whether waiting can still help
# the engine's problems (a pipeline stage down) this long during the grace period end it: by then it is not a
# short repair (a broken link between live workers, a local worker's restart: well under a second)
DOWN_GRACE_S = 5.0
ENGINE_WATCH_S = 1.0  # how often serve() asks whether the engine can still serve


async def _watch_engine(state: ServerState, stop: asyncio.Event, dead: list[str]) -> None:
    fatal = getattr(state.engine, "fatal", None)
    if fatal is None:
        return
    while not stop.is_set():
        await asyncio.sleep(ENGINE_WATCH_S)
        found = fatal()
        if found:
            dead += found
            say_line(f"flotilla: the engine cannot serve again ({'; '.join(found)}): shutting down, so that a "
                     f"supervisor can restart the server")
            stop.set()


ACCEPT_ERROR_EVERY_S = 60.0  # the shortest time between two reports of failing accepts


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, idle_timeout: float) -> None:
    """Report a listening socket's failing accepts (out of file descriptors: too many open connections) once a
    minute with their count, not asyncio's traceback each time it retries (measured: 700 MB of log in 2 minutes
    under a flood of idle connections). Other errors go to the handler there was."""
    previous = loop.get_exception_handler()
    state = {"last": -ACCEPT_ERROR_EVERY_S, "count": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = loop.time()
        if now - state["last"] >= ACCEPT_ERROR_EVERY_S:
            exc = context.get("exception")
            say_line(f"flotilla: cannot accept connections ({exc.strerror if isinstance(exc, OSError) else exc}; "
                     f"{state['count']} times since the last report): too many are open; idle ones are closed after "
                     f"{idle_timeout:g} s")
            state["last"], state["count"] = now, 0

    loop.set_exception_handler(handler)


def _announce(text: str) -> None:
    print(text, file=sys.stdout, flush=True)
