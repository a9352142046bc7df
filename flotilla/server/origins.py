"""Which web pages may use the server: the Origin a browser sends, against --allowed-origins.

A browser sends `Origin` with every websocket handshake and every cross-site request. Websockets are not
covered by the browser's same-origin rule, so GET /ws refuses a page whose origin is neither this
server's own (its chat page) nor one of --allowed-origins: otherwise any site the user visits could drive
the model through a server on localhost and read the replies. The HTTP API answers CORS preflights for
those origins only and refuses (403) a POST from any other page's origin before anything runs, also one
that needs no preflight (a body with no Content-Type; state.check_json_type refuses the form and text
types). A preflight and the request it announces get the same answer (`cors_grant`). Clients that are
not browsers (the OpenAI library, curl) send no Origin and are not affected.

"This server's own origin" is what a browser means by it: scheme, host and port, a default port (80, 443)
implied; another port of the same host is another origin, and so is another name of the same address
(http://localhost:8000 is not http://127.0.0.1:8000 to a browser, so not to this check). Behind a
reverse proxy (a request with X-Forwarded-Proto, X-Forwarded-Host or Forwarded) only the host name is compared, the
X-Forwarded-Host's or the Host header's: the scheme and port a proxy reports are its own listener's, not
the browser's (a container published on another port, TLS ended in front of the proxy). Not covered: DNS rebinding (a hostile name
that resolves to 127.0.0.1 is "the same origin" to this check); --api-key covers that.
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


def _first(request: web.Request, name: str) -> str:
    return request.headers.get(name, "").split(",")[0].strip()


def _split(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) origin, its default port filled in; None for anything else."""
    u = urlsplit(origin.strip())
    scheme = u.scheme.lower()
    try:
        port = u.port
    except ValueError:
        return None
    if scheme not in DEFAULT_PORTS or not u.hostname:
        return None
    return scheme, u.hostname.lower(), port or DEFAULT_PORTS[scheme]


# what a reverse proxy in front of the server sends (deploy/nginx.conf: X-Forwarded-Proto); not X-Forwarded-For,
# which a forward proxy on the browser's side (Squid) adds too
_PROXY_HEADERS = ("X-Forwarded-Proto", "X-Forwarded-Host", "Forwarded")


def server_origin(request: web.Request) -> tuple[str | None, str, int | None]:
    """(scheme, host, port) the client addressed, as a browser would write its origin. A request a proxy
    forwarded has scheme and port None: what a proxy says of them describes its own listener, not the URL in
    the browser (nginx in a container published on another port, a TLS load balancer in front of it)."""
    proxied = any(h in request.headers for h in _PROXY_HEADERS)
    u = urlsplit("//" + (_first(request, "X-Forwarded-Host") or request.host))
    host = (u.hostname or "").lower()
    if proxied:
        return None, host, None
    try:
        port = u.port
    except ValueError:
        port = None
    return request.scheme, host, port if port is not None else DEFAULT_PORTS.get(request.scheme)


def is_same_origin(request: web.Request, origin: str) -> bool:
    """`origin` is the scheme, host and port this request was sent to (see the module's docstring)."""
    page = _split(origin)
    if page is None:
        return False
    scheme, host, port = server_origin(request)
    return page[1] == host and scheme in (None, page[0]) and port in (None, page[2])


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


def cors_grant(request: web.Request, config: ServerConfig) -> str | None:
    """Access-Control-Allow-Origin for this request, the same for a preflight and the request it announces:
    an allowed origin's value, the page's own origin where it is this server's, else None (no grant)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    allow = allowed_origin(request, config)
    if allow is None and is_same_origin(request, origin):
        allow = origin
    return allow


def origin_refusal(request: web.Request, config: ServerConfig) -> str | None:
    """Why this request's page may not use the server, or None (no Origin: not a browser; its own page; an
    allowed one). Said once per origin in the log too."""
    origin = request.headers.get("Origin")
    if origin is None or cors_grant(request, config) is not None:
        return None
    shown = origin[:200]
    if origin == "null":  # a file:// page, a sandboxed frame
        why = ("pages with no origin (a file:// page, a sandboxed frame) are refused; serve the page from a web "
               "server and name it in --allowed-origins (or --allowed-origins '*' to let every page in)")
    else:
        scheme, host, port = server_origin(request)
        name = "[" + host + "]" if ":" in host else host
        own = normalize_origin(f"{scheme}://{name}" + (f":{port}" if port else "")) if scheme else f"{name} (proxied)"
        why = (f"pages on {shown} are refused; start the server with --allowed-origins {shown} to let them in "
               f"(this server is {own[:100]}: another scheme, host name or port is another site to a browser)")
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
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": cors_grant(request, config) or "*", "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked[:1000] or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)})
    return cors


def add_cors_headers(config: ServerConfig):
    """An on_response_prepare hook: every response (streams and errors too) to a granted origin says so, and
    every answer to a request with an Origin varies by it."""
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if "Origin" not in request.headers:
            return
        allow = cors_grant(request, config)
        if allow is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = allow
        if "Origin" not in response.headers.getall("Vary", []):
            response.headers.add("Vary", "Origin")
    return on_prepare
