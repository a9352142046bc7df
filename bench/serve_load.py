"""Server load on the CPU: requests/s, time to first token and inter-token latency at several
numbers of concurrent streams, over HTTP (SSE) against the engine driven directly in the same run.

    python bench/serve_load.py [MODEL] [engine options] [--concurrency 1,8,32,128] [--max-tokens 32] [--json]

Each level runs a closed loop: C clients, each sending its next request when the previous one
ends. The engine rows drive `EngineClient.generate` in this process; the server rows talk to a
`runtime serve` subprocess on loopback with aiohttp. Server overhead = 1 - server tok/s / engine
tok/s (target <= 10%). On a small machine the client's own CPU use lands in the server's figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPT = "Request {i}: write a short story about a lighthouse keeper and a storm at sea."


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    wall: float = 0.0

    def add(self, other: "Run") -> "Run":
        return Run(self.ttft + other.ttft, self.itl + other.itl, self.tokens + other.tokens,
                   self.requests + other.requests, self.errors + other.errors, self.wall + other.wall)

    def row(self, side: str, streams: int) -> dict:
        p = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 2) if xs else None  # noqa: E731
        return {"side": side, "streams": streams, "requests": self.requests, "errors": self.errors,
                "tok_per_s": round(self.tokens / self.wall, 2), "req_per_s": round(self.requests / self.wall, 3),
                "ttft_p50_ms": p(self.ttft, 50), "ttft_p99_ms": p(self.ttft, 99),
                "itl_p50_ms": p(self.itl, 50), "itl_p99_ms": p(self.itl, 99)}


async def closed_loop(streams: int, total: int, one) -> Run:
    run, queue = Run(), list(range(total))

    async def client():
        while queue:
            await one(queue.pop(), run)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    run.wall = time.perf_counter() - start
    return run


def record(run: Run, start: float, times: list[float], tokens: int) -> None:
    run.requests += 1
    run.tokens += tokens
    if times:
        run.ttft.append(times[0] - start)
        run.itl.extend(b - a for a, b in zip(times, times[1:]))


async def engine_level(engine, tok, streams: int, total: int, max_tokens: int) -> Run:
    from flotilla.server.engine_client import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int, run: Run):
        start, times, n = time.perf_counter(), [], 0
        async for out in engine.generate(f"bench-{uuid.uuid4().hex}", tok.encode(PROMPT.format(i=i)), params):
            if out.token_ids:
                times.append(time.perf_counter())
                n += len(out.token_ids)
        record(run, start, times, n)

    return await closed_loop(streams, total, one)


async def server_level(url: str, model: str, streams: int, total: int, max_tokens: int) -> Run:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(i: int, run: Run):
            body = {"model": model, "prompt": PROMPT.format(i=i), "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            start, times, n = time.perf_counter(), [], 0
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    run.errors += 1
                    return
                async for line in resp.content:
                    if b'"usage":{' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
                    elif line.startswith(b'data: {"id"') and b'"text":""' not in line:
                        times.append(time.perf_counter())
            record(run, start, times, n)

        return await closed_loop(streams, total, one)


def start_server(engine_argv: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", *engine_argv, "--port", "0",
                             "--max-queue", "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    for line in proc.stdout:
        if m := re.search(r"chat page: (http://\S+)/$", line.strip()):
            return proc, m.group(1)
    raise SystemExit("runtime serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32,128", help="comma-separated stream counts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(2 x streams, 8))")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each level this many times, alternating which side goes first (a noisy machine)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args, engine_argv = ap.parse_known_args()
    if not any(a.startswith("--kv-cache-") for a in engine_argv):  # the same pool on both sides
        engine_argv += ["--kv-cache-memory", "1GiB"]

    from flotilla.server.cli import _serve_args
    from flotilla.server.engine_client import EngineClient

    serve_parser = argparse.ArgumentParser()
    _serve_args(serve_parser)
    engine = EngineClient.from_args(serve_parser.parse_args(engine_argv))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    proc, url = start_server(engine_argv)  # idle while the engine runs alone

    async def run_levels():
        await engine.start()
        try:
            await engine_level(engine, engine.tokenizer, 1, 2, 4)  # warm-up both
            await server_level(url, engine.model_name, 1, 2, 4)
            for c in levels:  # interleaved, so that a drifting machine hits both sides alike
                total = args.requests or max(2 * c, 8)
                runs = {"engine": Run(), "server": Run()}
                for r in range(args.repeat):
                    for side in (("engine", "server") if r % 2 == 0 else ("server", "engine")):
                        run = (await engine_level(engine, engine.tokenizer, c, total, args.max_tokens)
                               if side == "engine" else
                               await server_level(url, engine.model_name, c, total, args.max_tokens))
                        runs[side] = runs[side].add(run)
                rows.extend([("engine", c, runs["engine"]), ("server", c, runs["server"])])
        finally:
            await engine.shutdown()

    try:
        asyncio.run(run_levels())
    finally:
        proc.terminate()
        proc.wait()

    by = {(side, c): r.row(side, c) for side, c, r in rows}
    out = []
    for c in levels:
        e, s = by[("engine", c)], by[("server", c)]
        s["overhead_pct"] = round(100 * (1 - s["tok_per_s"] / e["tok_per_s"]), 1)
        out += [e, s]
    if args.json:
        for row in out:
            print(json.dumps(row))
        return
    cols = ["side", "streams", "requests", "errors", "tok_per_s", "req_per_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "overhead_pct"]
    print(f"serve_load: {engine.model_name}, max_tokens={args.max_tokens}, completions streamed over SSE, "
          f"repeat={args.repeat}")
    print("  ".join(f"{c:>12}" for c in cols))
    for row in out:
        print("  ".join(f"{str(row.get(c, '')):>12}" for c in cols))


if __name__ == "__main__":
    main()
