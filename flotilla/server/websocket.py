"""GET /ws: streaming chat over a websocket.

Client -> server (JSON text frames):
    {"type": "chat", "messages": [...], "max_tokens": 256, "temperature": 0.7, ...}  one reply
    {"type": "cancel"}                         stop the reply streaming (ignored when none is)
    {"type": "ping"}                                                                 -> pong
Server -> client:
    {"type": "ready", "model", "max_model_len"}            once, on connect
    {"type": "start", "id", "prompt_tokens"}               a reply begins
    {"type": "delta", "id", "text"}                        streamed text
    {"type": "done", "id", "finish_reason", "usage", "timing"}
        finish_reason: "stop", "length", "cancelled" (the client's cancel) or "abort" (server shutdown)
    {"type": "error", "code", "message", "param"}          a bad frame; the socket stays open
One reply at a time per socket; many turns per socket. Binary frames close the socket with 1003;
a wrong API key closes it with 1008.
"""
from __future__ import annotations

import asyncio
import hmac
import time

from aiohttp import WSCloseCode, WSMsgType, web

from flotilla.errors import FlotillaError

from .engine_client import EngineUnavailable
from .errors import ApiError, bad_request
from .fields import describe, parse_json_object
from .generation import Generation, new_request_id
from .protocol import parse_chat
from .state import ServerState

LARGE_FRAME = 32 * 1024  # characters; larger chat frames are tokenized off the event loop
EXAMPLE = '{"type": "chat", "messages": [{"role": "user", "content": "Hi"}]}'


class ChatSocket:
    def __init__(self, state: ServerState):
        self.state = state

    def register(self, app: web.Application) -> None:
        app.router.add_get("/ws", self.handle)

    def _authorized(self, request: web.Request) -> bool:
        key = self.state.config.api_key
        if key is None:
            return True
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else request.query.get("api_key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.state.config.max_body_bytes, heartbeat=30.0)
        await ws.prepare(request)
        if not self._authorized(request):
            await ws.close(code=WSCloseCode.POLICY_VIOLATION,
                           message=b"unauthorized: send 'Authorization: Bearer KEY' or ?api_key=KEY")
            return ws
        self.state.websockets.add(ws)
        engine = self.state.engine
        await ws.send_json({"type": "ready", "model": engine.model_name, "max_model_len": engine.max_model_len})
        conversation = _Conversation(self.state, ws)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await conversation.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await ws.close(code=WSCloseCode.UNSUPPORTED_DATA,
                                   message=b"binary frames are not supported; send JSON text frames")
                    break
        finally:
            await conversation.stop()
            self.state.websockets.discard(ws)
        return ws


class _Conversation:
    """One socket's state: at most one reply in flight."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse):
        self.state = state
        self.ws = ws
        self.reply: asyncio.Task | None = None
        self.generation: Generation | None = None
        self.cancelled = False

    async def error(self, e: ApiError) -> None:
        if not self.ws.closed:
            await self.ws.send_json({"type": "error", "code": e.status, "message": e.message, "param": e.param})

    async def on_text(self, text: str) -> None:
        try:
            data = parse_json_object(text, "frame", EXAMPLE)
        except ApiError as e:
            return await self.error(e)
        kind = data.get("type")
        if kind == "chat":
            return await self.on_chat(data, text)
        if kind == "cancel":
            return await self.cancel()
        if kind == "ping":
            return await self.ws.send_json({"type": "pong"})
        await self.error(bad_request(f"unknown frame type {describe(kind)}; use \"chat\", \"cancel\" or \"ping\"",
                                     param="type"))

    async def on_chat(self, data: dict, text: str) -> None:
        if self.reply is not None and not self.reply.done():
            return await self.error(ApiError(409, "a reply is still streaming; send {\"type\": \"cancel\"} or wait for "
                                                  "its \"done\" frame"))
        arrival = time.perf_counter()
        try:
            self.state.admission.check_open()
            if data.get("n", 1) != 1:
                raise bad_request("'n' must be 1 on the websocket", param="n")
            if data.get("stream") is False:
                raise bad_request("the websocket always streams; leave out 'stream'", param="stream")
            fields = {k: v for k, v in data.items() if k not in ("type", "stream", "stream_options")}
            args = (fields, self.state.engine, 1)
            if len(text) > LARGE_FRAME:  # tokenizing it would stall every other stream
                req = await asyncio.to_thread(parse_chat, *args, require_model=False)
            else:
                req = parse_chat(*args, require_model=False)
        except ApiError as e:
            return await self.error(e)
        self.cancelled = False
        self.reply = asyncio.create_task(self.run(req, arrival))

    async def cancel(self) -> None:
        """Stop the reply in flight; with none, nothing to do (a cancel that crosses the reply's
        "done" frame is not a mistake). A reply not yet in the engine never enters it."""
        if self.reply is None or self.reply.done():
            return
        self.cancelled = True
        if self.generation is not None:
            await self.generation.abort()

    async def run(self, req, arrival: float) -> None:
        rid = new_request_id("chat")
        ws = self.ws
        try:
            with self.state.admission.admit(1):
                async with Generation(self.state.engine, self.state.metrics, req, rid, arrival) as gen:
                    self.generation = gen
                    await ws.send_json({"type": "start", "id": rid, "prompt_tokens": gen.prompt_tokens})
                    # cancelled before reaching the engine: it never gets there. No await between
                    # this check and outputs() adding the request, so a later cancel finds it there.
                    finish, first, last = ("abort", None, None) if self.cancelled else await self._stream(gen, rid)
                    if finish == "abort" and self.cancelled:
                        finish = "cancelled"
                    n = gen.completion_tokens
                    timing = {"ttft": round(first - arrival, 4) if first else None,
                              "tokens_per_second": round((n - 1) / (last - first), 2) if n > 1 and last > first
                              else None}
                    await ws.send_json({"type": "done", "id": rid, "finish_reason": finish, "usage": gen.usage(),
                                        "timing": timing})
        except ApiError as e:
            await self.error(e)
        except EngineUnavailable as e:
            await self.error(ApiError(503, f"the engine cannot serve: {e}", code="engine_unavailable"))
        except FlotillaError as e:  # a request the engine refuses that validation let through
            await self.error(bad_request(str(e)))
        except ConnectionResetError:
            pass  # the socket closed; leaving the Generation aborted the request
        finally:
            self.generation = None

    async def _stream(self, gen: Generation, rid: str) -> tuple[str | None, float | None, float | None]:
        """Send the reply's deltas; (finish_reason, time of the first token, time of the last)."""
        first = last = finish = None
        async for _, out in gen.outputs():
            if out.token_ids:
                first, last = first or time.perf_counter(), time.perf_counter()
            if out.text:
                await self.ws.send_json({"type": "delta", "id": rid, "text": out.text})
            finish = out.finish_reason
        return finish, first, last

    async def stop(self) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()
            await asyncio.gather(self.reply, return_exceptions=True)
