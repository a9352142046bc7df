"""What every handler shares: settings, the engine, metrics, admission, open websockets."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from aiohttp import web

from .admission import Admission
from .config import ServerConfig
from .engine_client import EngineClient
from .errors import ApiError
from .metrics import ServerMetrics


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineClient
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    admission: Admission | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    websockets: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def __post_init__(self):
        if self.admission is None:
            self.admission = Admission(self.engine.max_num_seqs, self.config.max_queue, self.config.retry_after)

    async def read_json(self, request: web.Request) -> dict:
        from .fields import parse_json_object

        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, limit) from None
        return parse_json_object(raw)


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more than that"
    return ApiError(413, f"the request body is {got}; the limit is {limit} bytes (--max-body-bytes): "
                         f"send a shorter prompt", code="request_too_large")
