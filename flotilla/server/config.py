"""The server's settings, fixed at start (the engine's own settings live with the engine)."""
from __future__ import annotations

from dataclasses import dataclass

from flotilla.errors import FlotillaError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 512  # sequences allowed to wait for a running slot; beyond it: 429
    max_body_bytes: int = 2 * 1024 * 1024  # request bodies and websocket frames
    body_timeout: float = 60.0  # seconds a request body may take to arrive once its headers have (then 408)
    # seconds a connection may hold without a whole request's headers (a new one, or a kept-alive one between
    # requests): then it is closed (nginx's client_header_timeout and keepalive_timeout alike)
    idle_timeout: float = 60.0
    max_n: int = 8  # choices (n) one request may ask for per prompt (prompts x n: admission's bound)
    grace_period: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    retry_after: int = 1  # seconds, sent with 429
    # web origins ("https://app.example.com", or "*") whose pages may call the API and open /ws; the server's own
    # chat page (same origin) always may, and clients that are not browsers send no Origin
    allowed_origins: tuple[str, ...] = ()
    # a reasoning model's <think> block as the chat API's `reasoning` field (server/reasoning.py; vLLM's names)
    reasoning_parser: str | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise FlotillaError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise FlotillaError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_n < 1:
            raise FlotillaError(f"--max-n must be >= 1, got {self.max_n}")
        if self.max_body_bytes < 1024:
            raise FlotillaError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.grace_period < 0:
            raise FlotillaError(f"--grace-period must be >= 0 seconds, got {self.grace_period}")
        for origin in self.allowed_origins:
            if origin != "*" and not _is_origin(origin):
                raise FlotillaError(f"--allowed-origins: {origin!r} is not an origin; write scheme://host[:port] "
                                    f"(e.g. http://localhost:3000), each in full (no * inside), or * alone")
        if self.api_key is not None and not self.api_key.strip():
            raise FlotillaError("the API key is empty; pass a non-empty --api-key or leave it out")


def _is_origin(origin: str) -> bool:
    from urllib.parse import urlsplit

    u = urlsplit(origin)
    try:
        u.port
    except ValueError:
        return False
    return (u.scheme in ("http", "https") and bool(u.hostname) and "*" not in u.netloc and "@" not in u.netloc
            and u.path in ("", "/") and not (u.query or u.fragment))


def parse_origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins' comma-separated list, trailing slashes dropped."""
    return tuple(o.strip().rstrip("/") for o in (value or "").split(",") if o.strip())
