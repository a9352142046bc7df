"""Which web pages may use the server: the Origin a browser sends, against --allowed-origins.

A browser sends `Origin` with every websocket handshake and every cross-site request. Websockets are not
covered by the browser's same-origin rule, so GET /ws refuses a page whose origin is neither this
server's own (its chat page: the same host name) nor one of --allowed-origins: otherwise any site the
user visits could drive the model through a server on localhost and read the replies. The HTTP API
answers CORS preflights for the allowed origins only and refuses (403) a POST from any other page's
origin, also one that needs no preflight (a body with no Content-Type; state.check_json_type refuses
the form and text types). Clients that are not browsers (the OpenAI library, curl) send no Origin and
are not affected. Not covered: DNS rebinding (a hostile name that resolves to 127.0.0.1 is "the same
host" to this check); --api-key covers that.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

from aiohttp import web

from .config import ServerConfig
from .errors import ApiError

log = logging.getLogger("flotilla.server")

DEFAULT_PORTS = {"http": 80, "https": 443}
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight's answer
CLOSE_ORIGIN = 4003  # the websocket close code of a refused origin (the page shows the reason)
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_refused_logged: set[str] = set()


def normalize_origin(origin: str) -> str:
    """scheme://host[:port] lower-cased, a default port dropped: how a browser writes an Origin."""
    u = urlsplit(origin.strip().rstrip("/"))
    host = (u.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = u.port
    except ValueError:
        port = None
    scheme = u.scheme.lower()
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != DEFAULT_PORTS.get(scheme) else "")


def _hostname(netloc: str) -> str:
    return (urlsplit(f"//{netloc}").hostname or netloc).lower()


def is_same_origin(request: web.Request, origin: str) -> bool:
    """`origin`'s host name is the one this request was sent to (X-Forwarded-Host where a proxy sets it).
    Host names only: a proxy that passes the Host header on keeps its port and scheme to itself."""
    u = urlsplit(origin)
    if u.scheme not in ("http", "https") or not u.netloc:
        return False
    host = request.headers.get("X-Forwarded-Host", "").split(",")[0].strip() or request.host
    return _hostname(u.netloc) == _hostname(host)


def allowed_origin(request: web.Request, config: ServerConfig) -> str | None:
    """The value of Access-Control-Allow-Origin for this request: None where it has no Origin or one that
    --allowed-origins does not name."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    if "*" in config.allowed_origins:
        return "*"
    allowed = {normalize_origin(o) for o in config.allowed_origins}  # as a browser writes them
    return origin if normalize_origin(origin) in allowed else None


def origin_refusal(request: web.Request, config: ServerConfig) -> str | None:
    """Why this request's page may not use the server, or None (no Origin: not a browser; its own page; an
    allowed one). Said once per origin in the log too."""
    origin = request.headers.get("Origin")
    if origin is None or is_same_origin(request, origin) or allowed_origin(request, config) is not None:
        return None
    shown = origin[:200]
    if origin == "null":  # a file:// page, a sandboxed frame
        why = ("pages with no origin (a file:// page, a sandboxed frame) are refused; serve the page from a web "
               "server and name it in --allowed-origins (or --allowed-origins '*' to let every page in)")
    else:
        why = f"pages on {shown} are refused; start the server with --allowed-origins {shown} to let them in"
    if shown not in _refused_logged and len(_refused_logged) < 100:
        _refused_logged.add(shown)
        log.warning("refused a request from a web page on %s (%s %s): not this server's origin nor one of "
                    "--allowed-origins", shown, request.method, request.path[:100])
    return why


async def refuse_websocket(request: web.Request, config: ServerConfig) -> web.WebSocketResponse | None:
    """A handshake from another site's page is accepted, then closed with CLOSE_ORIGIN and the reason (a 403
    before the upgrade reaches a page only as "connection failed", with nothing to show its user)."""
    why = origin_refusal(request, config)
    if why is None:
        return None
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.close(code=CLOSE_ORIGIN, message=why[:120].encode())  # a close reason is at most 123 bytes
    return ws


def cors_middleware(config: ServerConfig):
    @web.middleware
    async def cors(request: web.Request, handler):
        preflight = request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
        if not preflight and request.method in _SAFE_METHODS:
            return await handler(request)
        why = origin_refusal(request, config)
        if why is not None:  # a preflight, or a post that needs none (no Content-Type: a Blob body)
            raise ApiError(403, f"cross-origin request refused: {why}", code="origin_not_allowed")
        if not preflight:
            return await handler(request)
        asked = request.headers.get("Access-Control-Request-Headers", "")
        allow = allowed_origin(request, config) or request.headers.get("Origin", "*")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": allow, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked[:1000] or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)})
    return cors


def add_cors_headers(config: ServerConfig):
    """An on_response_prepare hook: every response (streams and errors too) to an allowed origin says so, and
    every answer to a request with an Origin varies by it."""
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if "Origin" not in request.headers:
            return
        allow = allowed_origin(request, config)
        if allow is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = allow
        if "Origin" not in response.headers.getall("Vary", []):
            response.headers.add("Vary", "Origin")
    return on_prepare
