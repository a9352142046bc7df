"""GET /ws: streaming chat over a websocket.

Client -> server (JSON text frames):
    {"type": "chat", "messages": [...], "max_tokens": 256, "temperature": 0.7, ...}  one reply
        with "fit_context": true the oldest turns are dropped (never the leading system messages nor the
        last message) until the prompt leaves room for the reply, as `runtime chat` does (see fit_context)
    {"type": "cancel"}                         stop the reply streaming (ignored when none is)
    {"type": "ping"}                                                                 -> pong
Server -> client:
    {"type": "ready", "model", "max_model_len", "max_frame_bytes"}   once, on connect
    {"type": "start", "id", "prompt_tokens", "dropped_messages"}   a reply begins
    {"type": "delta", "id", "text"}                        streamed text; under serve --reasoning-parser
        the reply's <think> block comes apart from it as "reasoning" (server/reasoning.py), "text" the answer
    {"type": "done", "id", "finish_reason", "usage", "timing"}
        finish_reason: "stop", "length", "cancelled" (the client's cancel), "abort" (server shutdown)
        or "error" (the reply failed; its error frame came just before)
    {"type": "error", "code", "message", "param"}          a bad or refused frame; the socket stays open
    {"type": "error", "id", "code", "message", "param"}    a reply that failed after its "start"
Every "start" is followed by exactly one "done". One reply at a time per socket; many turns per
socket. Binary frames close the socket with 1003; a wrong API key closes it with 1008; a text frame
over --max-body-bytes (max_frame_bytes) gets a 413 error frame, and one over twice that closes the socket
with 1009 (aiohttp stops buffering it there, so a socket never holds more; a client still sending the rest
of such a frame may see the connection reset instead of the close frame). A handshake from a web page
on another host than the server's, not named by --allowed-origins, is closed with 4003 and the reason
(server/origins.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass

from aiohttp import WSCloseCode, WSMsgType, web

from flotilla.errors import FlotillaError

from .engine_client import EngineUnavailable
from .errors import ApiError, bad_request
from .fields import Fields, describe, parse_json_object
from .generation import Generation, log_ignored, new_request_id
from .origins import refuse_websocket
from .protocol import GenerationRequest, ModelInfo, parse_chat, parse_messages, render_chat
from .reasoning import ReasoningSplitter, prompt_end
from .state import ServerState

log = logging.getLogger("flotilla.server")

LARGE_FRAME = 32 * 1024  # characters; larger chat frames are tokenized off the event loop
BUFFERED_FRAME_FACTOR = 2  # frames up to this many times --max-body-bytes are read and refused with 413
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
        # the scheme is case-insensitive (RFC 7235), as the HTTP middleware reads it
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.query.get("api_key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        limit = self.state.config.max_body_bytes
        refused = await refuse_websocket(request, self.state.config)  # another site's page: closed with 4003
        if refused is not None:
            return refused
        ws = web.WebSocketResponse(max_msg_size=BUFFERED_FRAME_FACTOR * limit, heartbeat=30.0)
        await ws.prepare(request)
        if not self._authorized(request):
            await ws.close(code=WSCloseCode.POLICY_VIOLATION,
                           message=b"unauthorized: send 'Authorization: Bearer KEY' or ?api_key=KEY")
            return ws
        self.state.websockets.add(ws)
        engine = self.state.engine
        try:
            await ws.send_json({"type": "ready", "model": engine.model_name, "max_model_len": engine.max_model_len,
                                "max_frame_bytes": limit})
        except ConnectionResetError:  # the client left during the handshake
            self.state.websockets.discard(ws)
            return ws
        conversation = _Conversation(self.state, ws)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    size = _utf8_size(msg.data, limit)
                    if size > limit:
                        await conversation.error(ApiError(
                            413, f"the frame is {size} bytes; the limit is {limit} bytes (--max-body-bytes): "
                                 f"send a shorter message", code="request_too_large"))
                    else:
                        await conversation.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await ws.close(code=WSCloseCode.UNSUPPORTED_DATA,
                                   message=b"binary frames are not supported; send JSON text frames")
                    break
        finally:
            await conversation.stop()
            self.state.websockets.discard(ws)
        return ws


def _utf8_size(text: str, limit: int) -> int:
    """The frame's size in UTF-8 bytes as sent; where it cannot pass `limit` (a character is at most 4
    bytes), its length in characters stands for it, with no copy."""
    return len(text) if 4 * len(text) <= limit else len(text.encode("utf-8"))


def fit_context(fields: dict, model: ModelInfo) -> tuple[dict, int]:
    """A chat frame's fields with the oldest turns dropped until the prompt leaves room for the reply,
    as `runtime chat` does: (fields, messages dropped). The room is max_tokens (the whole context when
    absent), at most half the context; a larger max_tokens is lowered to what the kept prompt leaves.
    The leading system messages and the last message always stay, and the kept turns start at a user
    message (a user turn goes with the replies after it). Where the last message alone leaves no room,
    the refusal says so."""
    f = Fields(fields)
    messages = parse_messages(f)
    key = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    max_tokens = f.integer(key, None, 1, None)
    context = model.max_model_len
    room = min(max_tokens or context, context // 2)
    keep = 0
    while keep < len(messages) - 1 and messages[keep]["role"] == "system":
        keep += 1
    last = len(messages) - 1
    starts = [keep] + [i for i in range(keep + 1, len(messages)) if i == last or messages[i]["role"] == "user"]
    lengths: dict[int, int] = {}

    def length(j: int) -> int:  # prompt tokens with the turns before starts[j] dropped
        if j not in lengths:
            lengths[j] = len(render_chat(f, messages[:keep] + messages[starts[j]:], model))  # as parse_chat will
        return lengths[j]

    def fits(j: int) -> bool:
        return length(j) + room <= context

    best = 0
    if not fits(0):
        lo, hi = 1, len(starts) - 1  # the prompt shrinks as turns go: the first start that fits
        if not fits(hi):
            what = "the last message with the system prompt" if keep else "the last message alone"
            raise bad_request(f"{what} is {length(hi)} tokens, and with {room} for the reply that passes the "
                              f"{context}-token context even with every earlier turn dropped; send a shorter "
                              f"message", param="messages", code="context_length_exceeded")
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        best = lo
    raw = fields["messages"]
    fitted = {**fields, "messages": raw[:keep] + raw[starts[best]:]}
    if max_tokens is not None and max_tokens > context - length(best):
        fitted[key] = context - length(best)
        if f.integer("min_tokens", 0, 0, None) > fitted[key]:  # lowered with it, not left to refuse the frame
            fitted["min_tokens"] = fitted[key]
    return fitted, starts[best] - keep


def parse_frame(fields: dict, model: ModelInfo) -> tuple[GenerationRequest, int]:
    """A chat frame's request and the number of messages `fit_context` dropped for it."""
    dropped = 0
    if Fields(fields).boolean("fit_context", False):
        fields, dropped = fit_context(fields, model)
    fields = {k: v for k, v in fields.items() if k != "fit_context"}
    return parse_chat(fields, model, 1), dropped


class _SocketGone(Exception):
    """The client left: nothing more can be sent."""


@dataclass
class _Reply:
    id: str
    arrival: float
    first: float | None = None  # when its first and last tokens came
    last: float | None = None

    def done(self, gen: Generation, finish: str | None) -> dict:
        n = gen.completion_tokens
        first, last = self.first, self.last
        timing = {"ttft": round(first - self.arrival, 4) if first else None,
                  "tokens_per_second": round((n - 1) / (last - first), 2) if n > 1 and last > first else None}
        return {"type": "done", "id": self.id, "finish_reason": finish, "usage": gen.usage(), "timing": timing}


class _Conversation:
    """One socket's state: at most one reply in flight."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse):
        self.state = state
        self.ws = ws
        self.reply: asyncio.Task | None = None
        self.generation: Generation | None = None
        self.cancelled = False

    async def send(self, frame: dict) -> None:
        if self.ws.closed:
            raise _SocketGone()
        try:
            await self.ws.send_json(frame)
        except ConnectionResetError:
            raise _SocketGone() from None

    async def error(self, e: ApiError, reply_id: str | None = None) -> None:
        frame = {"type": "error", **({"id": reply_id} if reply_id else {}), "code": e.status, "message": e.message,
                 "param": e.param}
        try:
            await self.send(frame)
        except _SocketGone:
            pass

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
        if kind == "ping":  # (to a client that has left: nothing to answer, and no server error)
            try:
                await self.send({"type": "pong"})
            except _SocketGone:
                pass
            return
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
            for name in ("logprobs", "top_logprobs", "prompt_logprobs"):  # (prompt_logprobs 0 asks for some too)
                if data.get(name) not in (None, False, 0) or (name == "prompt_logprobs" and data.get(name) == 0):
                    raise bad_request(f"the websocket's frames carry no logprobs; leave out '{name}', or ask "
                                      f"POST /v1/chat/completions for them", param=name)
            fields = {k: v for k, v in data.items() if k not in ("type", "stream", "stream_options")}
            # tokenizing a large frame (or fitting one: several tokenizations) would stall every other stream
            if len(text) > LARGE_FRAME or data.get("fit_context") is True:
                req, dropped = await asyncio.to_thread(parse_frame, fields, self.state.engine)
            else:
                req, dropped = parse_frame(fields, self.state.engine)
        except ApiError as e:
            return await self.error(e)
        self.cancelled = False
        self.reply = asyncio.create_task(self.run(req, dropped, arrival))

    async def cancel(self) -> None:
        """Stop the reply in flight; with none, nothing to do (a cancel that crosses the reply's
        "done" frame is not a mistake). A reply not yet in the engine never enters it."""
        if self.reply is None or self.reply.done():
            return
        self.cancelled = True
        if self.generation is not None:
            await self.generation.abort()

    async def run(self, req: GenerationRequest, dropped: int, arrival: float) -> None:
        """One reply: "start", its deltas and "done"; a failure after "start" is an error frame and then
        "done" with finish_reason "error", so a client always sees its reply end."""
        reply = _Reply(new_request_id("chat"), arrival)
        log_ignored(req, reply.id)  # as over HTTP: a misspelt field is named in the log
        started: Generation | None = None
        try:
            with self.state.admission.admit(1):
                async with Generation(self.state.engine, self.state.metrics, req, reply.id, arrival) as gen:
                    self.generation = gen
                    await self.send({"type": "start", "id": reply.id, "prompt_tokens": gen.prompt_tokens,
                                     "dropped_messages": dropped})
                    started = gen
                    # cancelled before reaching the engine: it never gets there. No await between
                    # this check and outputs() adding the request, so a later cancel finds it there.
                    finish = "abort" if self.cancelled else await self._stream(gen, reply, req)
                    if finish == "abort" and self.cancelled:
                        finish = "cancelled"
            await self.send(reply.done(started, finish))
        except _SocketGone:
            pass  # the socket closed; leaving the Generation aborted the request
        except Exception as e:
            await self.error(_api_error(e, reply.id), reply.id if started is not None else None)
            if started is not None:
                try:
                    await self.send(reply.done(started, "error"))
                except _SocketGone:
                    pass
        finally:
            self.generation = None

    async def _stream(self, gen: Generation, reply: _Reply, req: GenerationRequest) -> str | None:
        """Send the reply's deltas (its <think> block apart under --reasoning-parser); its finish_reason."""
        finish = None
        parser = self.state.config.reasoning_parser
        tokenizer = self.state.engine.tokenizer
        splitter = ReasoningSplitter(parser, prompt_end(tokenizer, req.prompts[0])) if parser else None
        async for _, out in gen.outputs():
            if out.token_ids:
                now = time.perf_counter()
                reply.first, reply.last = reply.first or now, now
            if splitter is None:
                if out.text:
                    await self.send({"type": "delta", "id": reply.id, "text": out.text})
            else:
                reasoning, text = splitter.feed(out.text)
                if out.finish_reason:  # a piece of a tag held back at the end is text
                    r, t = splitter.finish()
                    reasoning, text = reasoning + r, text + t
                if reasoning or text:
                    await self.send({"type": "delta", "id": reply.id, "text": text,
                                     **({"reasoning": reasoning} if reasoning else {})})
            finish = out.finish_reason
        return finish

    async def stop(self) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()
            await asyncio.gather(self.reply, return_exceptions=True)


def _api_error(e: Exception, reply_id: str) -> ApiError:
    """What the client is told of a reply's failure (a bug's traceback goes to the log only)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineUnavailable):
        return ApiError(503, f"the engine cannot serve: {e}", code="engine_unavailable")
    if isinstance(e, FlotillaError):  # a request the engine refuses that validation let through
        return bad_request(str(e))
    log.error("websocket reply %s failed", reply_id, exc_info=e)
    return ApiError(500, "internal server error (a bug in the server; its log has the traceback)",
                    code="internal_error")
