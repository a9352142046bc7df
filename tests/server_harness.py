"""A live flotilla server on loopback for the server tests: the app runs in a background thread
with its own event loop; tests talk to it over real sockets (the openai client, aiohttp, a
browser) and may run coroutines on its loop to look at the engine directly."""
from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from pathlib import Path

from flotilla.server.config import ServerConfig
from flotilla.server.engine_client import EngineClient
from flotilla.server.serve import Server
from flotilla.server.state import ServerState


# a fixed KV budget (not a fraction of free memory) so that several test servers fit side by side;
# 512 MiB holds ~11k tokens of SmolLM2-135M in fp32: the model's whole 8192-token context
ENGINE_DEFAULTS = {"kv_cache_memory": "512MiB"}


@functools.lru_cache(maxsize=2)
def loaded_model(path: Path):
    """The model, loaded once per test session and shared by every server built on it."""
    from flotilla.runtime.loader import load_model

    return load_model(path)


class LiveServer:
    def __init__(self, engine: EngineClient, config: ServerConfig | None = None):
        self.engine = engine
        self.state = ServerState(config or ServerConfig(port=0), engine)
        self.loop = asyncio.new_event_loop()
        self.server: Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-server", daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        self.server = Server(self.state)
        self.call(self.server.start())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.drain(), timeout=60)
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def call(self, coro, timeout: float = 120):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def api(self) -> str:
        return self.server.url + "/v1"

    @property
    def ws_url(self) -> str:
        return self.server.url.replace("http://", "ws://") + "/ws"

    def engine_text(self, prompt_ids: list[int], params) -> tuple[str, list[int], str]:
        """The engine's own output for a prompt, outside HTTP: (text, token ids, finish_reason)."""
        async def run():
            text, ids, reason = [], [], None
            async for out in self.engine.generate(f"direct-{uuid.uuid4().hex}", prompt_ids, params):
                text.append(out.text)
                ids.extend(out.token_ids)
                reason = out.finish_reason
            return "".join(text), ids, reason
        return self.call(run())

    def stats(self):
        return self.engine.stats()


def start_server(model_path: Path, engine: dict | None = None, **config) -> LiveServer:
    """A live server on a free loopback port; `engine`: options for EngineClient.from_loaded,
    `config`: ServerConfig fields."""
    options = {**ENGINE_DEFAULTS, **(engine or {})}
    engine = EngineClient.from_loaded(loaded_model(model_path), **options)
    config.setdefault("port", 0)
    server = LiveServer(engine, ServerConfig(**config))
    server.model_path = model_path  # loaded_model(server.model_path): the same weights, for an oracle
    return server.__enter__()
