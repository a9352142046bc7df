"""Which web pages may use the server: the Origin a browser sends, against --allowed-origins.

A browser sends `Origin` with every websocket handshake and every cross-site request. Websockets are not
covered by the browser's same-origin rule, so GET /ws refuses a handshake from a page whose origin is
neither this server's own (its chat page) nor one of --allowed-origins: otherwise any site the user
visits could drive the model through a server on localhost and read the replies. The HTTP API answers
CORS preflights and sets Access-Control-Allow-Origin for the allowed origins only, so that other
pages can send requests but not read the answers, and a JSON body (state.check_json_type) needs a
preflight. Clients that are not browsers (the OpenAI library, curl) send no Origin and are not affected.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from .config import ServerConfig
from .errors import ApiError

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight's answer


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    u = urlsplit(f"//{netloc}")
    try:
        port = u.port
    except ValueError:
        return netloc.lower(), None
    return (u.hostname or "").lower(), port if port is not None else DEFAULT_PORTS.get(scheme)


def is_same_origin(request: web.Request, origin: str) -> bool:
    """`origin` names the host and port this request was sent to (X-Forwarded-Host where a proxy sets it)."""
    u = urlsplit(origin)
    if u.scheme not in ("http", "https") or not u.netloc:
        return False
    host = request.headers.get("X-Forwarded-Host", "").split(",")[0].strip() or request.host
    scheme = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower() or request.scheme
    return _host_port(u.netloc, u.scheme) == _host_port(host, scheme)


def allowed_origin(request: web.Request, config: ServerConfig) -> str | None:
    """The value of Access-Control-Allow-Origin for this request: None where it has no Origin or one that
    --allowed-origins does not name."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    if "*" in config.allowed_origins:
        return "*"
    return origin if origin.rstrip("/") in config.allowed_origins else None


def check_websocket_origin(request: web.Request, config: ServerConfig) -> None:
    """A websocket handshake from another site's page gets a 403 (see the module's docstring)."""
    origin = request.headers.get("Origin")
    if origin is None or is_same_origin(request, origin) or allowed_origin(request, config) is not None:
        return
    raise ApiError(403, f"websocket connections from pages on {origin[:200]} are refused; start the server with "
                        f"--allowed-origins {origin[:200]} to allow them", code="origin_not_allowed")


def cors_middleware(config: ServerConfig):
    @web.middleware
    async def cors(request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin", "")
        allow = allowed_origin(request, config)
        if allow is None:
            raise ApiError(403, f"cross-origin requests from {origin[:200] or 'this page'} are refused; start the "
                                f"server with --allowed-origins {origin[:200] or 'ORIGIN'} to allow them",
                           code="origin_not_allowed")
        asked = request.headers.get("Access-Control-Request-Headers", "")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": allow, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked[:1000] or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)})
    return cors


def add_cors_headers(config: ServerConfig):
    """An on_response_prepare hook: every response (streams and errors too) to an allowed origin says so."""
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        allow = allowed_origin(request, config)
        if allow is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers.add("Vary", "Origin")
    return on_prepare
