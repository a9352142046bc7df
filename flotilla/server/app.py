"""The aiohttp application: routes, middleware, the chat page, /health (and /ping), /version and /metrics."""
from __future__ import annotations

from pathlib import Path

from aiohttp import WSCloseCode, web

from flotilla import __version__

from .metrics import CONTENT_TYPE
from .errors import ApiError
from .middleware import make_middlewares, quiet_client_mistakes
from .openai_api import OpenAIRoutes
from .tokenize_api import TokenizerRoutes
from .origins import add_cors_headers
from .state import ServerState
from .websocket import ChatSocket

STATIC = Path(__file__).resolve().parent / "static"


def build_app(state: ServerState, manage_engine: bool = True) -> web.Application:
    """`manage_engine`: start the engine with the app and shut it down with it."""
    quiet_client_mistakes()
    app = web.Application(middlewares=make_middlewares(state), client_max_size=state.config.max_body_bytes)
    OpenAIRoutes(state).register(app)
    TokenizerRoutes(state).register(app)
    ChatSocket(state).register(app)
    health = _health(state)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # vLLM's (SageMaker's) name for it, GET or POST
    app.router.add_post("/ping", health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics(state))
    app.router.add_get("/", _index)
    app.router.add_get("/static/{name}", _static)
    app.on_response_prepare.append(add_cors_headers(state.config))

    async def close_websockets(_app):
        for ws in list(state.websockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the server is shutting down")

    app.on_shutdown.append(close_websockets)
    if manage_engine:
        async def start(_app):
            await state.engine.start()

        async def stop(_app):
            await state.engine.shutdown()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
    return app


async def _index(request: web.Request) -> web.FileResponse:
    # not inside another site's frame: a framed page runs with this server's origin (and a saved API key)
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache", "X-Frame-Options": "DENY",
                                                            "Content-Security-Policy": "frame-ancestors 'none'"})


STATIC_FILES = {p.name: p for p in STATIC.iterdir() if p.is_file()}  # the chat page's files, read at import


async def _static(request: web.Request) -> web.FileResponse:
    path = STATIC_FILES.get(request.match_info["name"])
    if path is None:
        raise ApiError(404, f"no such file {request.path[:200]}; the chat page's files are "
                            f"{', '.join('/static/' + n for n in sorted(STATIC_FILES))}", code="not_found")
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def _health(state: ServerState):
    async def health(request: web.Request) -> web.Response:
        problems = list(state.engine.problems())
        if state.admission.draining:
            problems.append("the server is shutting down")
        stats = state.engine.stats()
        body = {"status": "ok" if not problems else ("draining" if state.admission.draining else "unhealthy"),
                "problems": problems, "model": state.engine.model_name, "running": stats.num_running,
                "waiting": stats.num_waiting, "in_flight": state.admission.in_flight,
                "kv_cache_usage": round(stats.kv_usage, 4), "kv_cache_free_blocks": stats.kv_blocks_free,
                "kv_cache_total_blocks": stats.kv_blocks_total, "auth_required": state.config.api_key is not None}
        return web.json_response(body, status=200 if not problems else 503)
    return health


def _metrics(state: ServerState):
    async def metrics(request: web.Request) -> web.Response:
        state.metrics.update_engine(state.engine.stats(), state.admission.in_flight)
        return web.Response(body=state.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})
    return metrics
