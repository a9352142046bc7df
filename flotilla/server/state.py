"""What every handler shares: settings, the engine, metrics, admission, open websockets."""
from __future__ import annotations

import asyncio
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
    # the connections (their transports' ids) that brought a request: serve.Server closes the others once
    # idle_timeout passes
    requested: set = field(default_factory=set)

    def __post_init__(self):
        if self.admission is None:
            self.admission = Admission(self.engine.max_num_seqs, self.config.max_queue, self.config.retry_after)
        self.metrics.name_model(self.engine.model_name)  # vLLM's metric names carry it

    async def read_json(self, request: web.Request) -> dict:
        from .fields import parse_json_object

        limit = self.config.max_body_bytes
        check_json_type(request)
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        try:  # a client that announces a body and stalls (a slowloris) does not hold the connection for ever
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, limit) from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout:g} s of its "
                                "headers; send the whole body (as its Content-Length says)",
                           code="request_timeout") from None
        return parse_json_object(raw)


def check_json_type(request: web.Request) -> None:
    """A body's Content-Type is JSON's or absent: a form or text/plain post (what a web page on another site can
    send without asking, and what `curl -d` sends by default) gets a 415 that says which header to send."""
    given = request.headers.get("Content-Type")
    if given is None:
        return
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json', not "
                            f"'{given[:100]}' (with curl: -H 'Content-Type: application/json')",
                       code="unsupported_media_type")


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f"is {size} bytes; the limit is" if size is not None else "is larger than the limit of"
    return ApiError(413, f"the request body {got} {limit} bytes (--max-body-bytes): send a shorter prompt",
                    code="request_too_large")
