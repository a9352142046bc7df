"""The `runtime` console script: runtime's own commands plus `serve`.

`flotilla.runtime` cannot import the server (dependencies point server -> runtime), so the
console script's entry point lives here and adds `serve` to runtime's command table.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from flotilla import envs
from flotilla.errors import FlotillaError
from flotilla.runtime.cli import COMMANDS, Command, run

from .config import ServerConfig, parse_origins
from .engine_client import add_engine_args
from .reasoning import PARSERS


def _serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env FLOTILLA_API_KEY)")
    key.add_argument("--api-key-file", default=None, help="read the API key from this file")
    g.add_argument("--max-queue", type=int, default=ServerConfig.max_queue,
                   help=f"sequences that may wait for a running slot; beyond: 429 (default {ServerConfig.max_queue})")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: from the path)")
    g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help=f"largest request body or websocket frame (default {ServerConfig.max_body_bytes})")
    g.add_argument("--max-n", type=int, default=ServerConfig.max_n, metavar="N",
                   help=f"most choices (n) a request may ask for per prompt (default {ServerConfig.max_n}; "
                        f"its prompts x n are bounded by --max-num-seqs + --max-queue)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the "
                        "API and open /ws (CORS); the server's own chat page always may; default: none")
    g.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="give a reasoning model's <think> block as the chat API's 'reasoning' (and "
                        "'reasoning_content') apart from 'content', as vLLM's parsers: deepseek_r1 (DeepSeek-R1 and "
                        "its distills, QwQ), qwen3 (Qwen3); default: the block stays in the content")
    g.add_argument("--grace-period", type=float, default=ServerConfig.grace_period,
                   help=f"seconds in-flight requests get to finish after SIGTERM (default {ServerConfig.grace_period:g})")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        path = Path(args.api_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as e:
            raise FlotillaError(f"--api-key-file {path}: cannot read it ({e.strerror})") from None
        if not key:
            raise FlotillaError(f"--api-key-file {path}: the file is empty; write the key into it")
        return key
    return envs.api_key()


def _serve(args: argparse.Namespace) -> int:
    from .engine_client import EngineClient
    from .listen import bind_sockets
    from .serve import EngineDied, serve
    from .state import ServerState

    config = ServerConfig(host=args.host, port=args.port, api_key=resolve_api_key(args), max_queue=args.max_queue,
                          max_body_bytes=args.max_body_bytes, grace_period=args.grace_period,
                          allowed_origins=parse_origins(args.allowed_origins), max_n=args.max_n,
                          reasoning_parser=args.reasoning_parser)
    sockets = bind_sockets(config.host, config.port)  # a port in use fails now, before the model loads
    try:
        engine = EngineClient.from_args(args)
        asyncio.run(serve(ServerState(config, engine), sockets=sockets))
    except EngineDied as e:
        print(f"error: the engine died: {e}", file=sys.stderr)
        return 1
    finally:
        for sock in sockets:
            sock.close()
    return 0


SERVE: Command = ("serve", "serve the model over HTTP: an OpenAI-compatible API, websocket chat and a chat page",
                  _serve_args, _serve)


def main(argv: list[str] | None = None) -> int:
    return run(argv, COMMANDS + [SERVE])


if __name__ == "__main__":
    sys.exit(main())
