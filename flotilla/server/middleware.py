"""Request middleware: OpenAI-shaped errors for everything, request counting, the API key; and one log
line, not a traceback, for a request aiohttp cannot even parse."""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from flotilla.errors import FlotillaError

from .engine_client import EngineUnavailable
from .errors import ApiError
from .origins import cors_middleware
from .state import ServerState

log = logging.getLogger("flotilla.server")

# open with --api-key, as vLLM's key guards /v1/* only (Prometheus scrapes /metrics without a token);
# /ws checks the key itself (a browser cannot set its headers)
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics", "/", "/favicon.ico", "/ws")
OPEN_PREFIXES = ("/static/",)


class ClientMistakes(logging.Filter):
    """On aiohttp's server logger: a request that aiohttp cannot parse (a duplicate Content-Type, a bad
    request line, a header too long) is answered by aiohttp itself with a plain-text 400, before any
    middleware sees it, and logged as "Error handling request" with a traceback. It is the client's
    mistake, not the server's: one line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "refused a malformed HTTP request from %s (%s): %s", (
                remote, type(exc).__name__, str(exc.message)[:200])
            record.exc_info = record.exc_text = None
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_client_mistakes() -> None:
    """Install ClientMistakes on aiohttp's server logger, once."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientMistakes) for f in logger.filters):
        logger.addFilter(ClientMistakes())


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource  # None for unmatched paths (aiohttp's system route)
    if resource is not None:
        return resource.canonical
    # a route's path with a method it does not take (a 405) keeps its endpoint; any other path is one label,
    # so that a scan of random paths cannot grow the metric without bound
    plain = {r.canonical for r in request.app.router.resources() if "{" not in r.canonical}
    return request.path if request.path in plain else "unmatched"


def _served(app: web.Application) -> str:
    """The app's endpoints as 'GET /health, POST /v1/completions, …' (HEAD and the page's static files left out)."""
    seen = dict.fromkeys(f"{r.method} {r.resource.canonical}" for r in app.router.routes()
                         if r.method != "HEAD" and r.resource is not None
                         and not r.resource.canonical.startswith("/static"))
    return ", ".join(seen)


def _http_error(request: web.Request, e: web.HTTPException, state: ServerState) -> ApiError:
    if e.status == 404:
        return ApiError(404, f"no such endpoint {request.method} {request.path[:200]}; the server serves "
                             f"{_served(request.app)}", code="not_found")
    if e.status == 405:
        allowed = e.headers.get("Allow", "")
        return ApiError(405, f"{request.method} is not allowed on {request.path[:200]}; use {allowed}",
                        code="method_not_allowed", headers={"Allow": allowed})
    if e.status == 413:
        return ApiError(413, f"the request body is too large; the limit is {state.config.max_body_bytes} bytes",
                        code="request_too_large")
    return ApiError(e.status, e.reason or e.text or "bad request")


def make_middlewares(state: ServerState) -> list:
    metrics = state.metrics

    @web.middleware
    async def errors(request: web.Request, handler):
        if request.transport is not None:  # this connection brought a request (serve.Server's idle check)
            state.requested.add(id(request.transport))
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except ApiError as e:
            status = e.status
            return e.response()
        except EngineUnavailable as e:
            status = 503
            return ApiError(503, f"the engine cannot serve: {e}", code="engine_unavailable").response()
        except FlotillaError as e:  # a request the engine refuses that validation let through
            status = 400
            return ApiError(400, str(e)).response()
        except web.HTTPException as e:
            if e.status < 400:
                status = e.status
                raise
            api = _http_error(request, e, state)
            status = api.status
            return api.response()
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return ApiError(500, "internal server error (a bug in the server; its log has the traceback)",
                            code="internal_error").response()
        finally:
            metrics.requests.inc(1, _endpoint(request), str(status))

    key = state.config.api_key

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if key is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "wrong API key: check the key you pass in 'Authorization: Bearer ...'",
                           code="invalid_api_key")
        return await handler(request)

    return [errors, cors_middleware(state.config), auth]
