"""Server-sent events: `data: <json>\\n\\n` frames, ended by `data: [DONE]`."""
from __future__ import annotations

import json

from aiohttp import web

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}  # nginx: do not buffer the stream


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class EventStream:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(status=200, headers=HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, *items: dict) -> None:
        await self.response.write(b"".join(event(d) for d in items))

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
