"""Command-line pieces of the pipeline: the `runtime worker` command and the `--pp` options of
`runtime serve` (which the server's CLI adds; the runtime never imports the server).

The shared token comes from `--token-file` or FLOTILLA_TOKEN; `--token T` works too (as users of
other tools expect) but warns that every user of the machine can read it (`ps`, shell history).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

from flotilla import envs
from flotilla.errors import FlotillaError
from flotilla.progress import say_line

from .activations import WIRE_DTYPES, check_wire_dtype
from .connection import MIN_TOKEN_LENGTH, check_token, format_address, parse_address, ssl_contexts
from .spin import SpinSelector

DEFAULT_PORT = 7070
HANG_MIN_S = 30.0  # local workers silent this long (or --stage-timeout, if longer) are killed and restarted


def _add_token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=None,
                   help="file holding the shared pipeline token (or set FLOTILLA_TOKEN); "
                        f"at least {MIN_TOKEN_LENGTH} characters")
    p.add_argument("--token", default=None,
                   help="the token itself (works, but every user of this machine can read it with ps; "
                        "prefer --token-file or FLOTILLA_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="TLS certificate (PEM) for pipeline connections")
    p.add_argument("--tls-key", default=None, help="its private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="CA (PEM) that the peers' certificates must chain to (mutual TLS)")


def read_token(args: argparse.Namespace, required: bool = True) -> bytes | None:
    if getattr(args, "token", None) is not None:
        if args.token_file:
            raise FlotillaError("--token and --token-file: give the token one way")
        print("warning: --token on the command line shows the secret to every user of this machine (ps, shell "
              "history); prefer --token-file FILE or FLOTILLA_TOKEN", file=sys.stderr)
        text, where = args.token.strip(), "--token"
    elif args.token_file:
        path = Path(args.token_file).expanduser()
        try:
            text = path.read_text().strip()
        except OSError as e:
            raise FlotillaError(f"--token-file {path}: cannot read it ({e.strerror})") from None
        where = f"--token-file {path}"
    else:
        text, where = envs.token() or "", "FLOTILLA_TOKEN"
    if not text:
        if required:
            raise FlotillaError("the pipeline needs a shared token: pass --token-file FILE or set FLOTILLA_TOKEN "
                                f"(at least {MIN_TOKEN_LENGTH} characters, e.g. from "
                                "`python -c 'import secrets; print(secrets.token_hex(16))'`)")
        return None
    try:
        return check_token(text)
    except ValueError as e:
        raise FlotillaError(f"{where}: {e}") from None


def at_least_one(text: str) -> int:
    """argparse type of a count (--pp, a worker's --tp): a whole number, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _tls(args: argparse.Namespace):
    if bool(args.tls_cert) != bool(args.tls_key):
        raise FlotillaError("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise FlotillaError("--tls-ca needs --tls-cert and --tls-key as well")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca)):
        if path and not Path(path).is_file():
            what = "a directory, not a file" if Path(path).is_dir() else "no such file"
            raise FlotillaError(f"{flag} {path}: {what}")
    try:
        return ssl_contexts(args.tls_cert, args.tls_key, args.tls_ca)
    except (OSError, ValueError) as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise FlotillaError(f"--tls-key {args.tls_key} is not the private key of --tls-cert {args.tls_cert}") \
                from None
        given = (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca))
        files = ", ".join(f"{flag} {path}" for flag, path in given if path)
        raise FlotillaError(f"cannot load the TLS files ({files}): {e}; each must be PEM") from None


# ------------------------------------------------------------------------------------- worker

def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, help=f"HOST:PORT to listen on, e.g. 0.0.0.0:{DEFAULT_PORT} (or fd:N, a "
                                                   f"listening socket inherited from the parent process)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--model", default=None,
                   help="this machine's copy of the model; without it (or if it is another model) the head "
                        "pushes the stage's shards, where the head serves a flotilla checkpoint (a GGUF file or "
                        "a Hugging Face directory must be here)")
    p.add_argument("--cache-dir", default=None,
                   help="where pushed shards are kept (default: FLOTILLA_CACHE_DIR/worker)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                   help="CPU threads for the stage's compute (default: torch's, one per core; with --tp on a CPU "
                        "the ranks split them)")
    p.add_argument("--tp", type=at_least_one, default=1, metavar="M",
                   help="tensor-parallel ranks for this worker's stage: M processes share every layer of it "
                        "(from --device cuda:K: GPUs cuda:K..K+M-1 over NCCL; on a CPU: processes over gloo; "
                        "default 1; vLLM's --tensor-parallel-size is the same)")
    p.add_argument("--tensor-parallel-size", dest="tp", type=at_least_one, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("--spin-us", type=int, default=0, metavar="US",
                   help="after each step, poll the sockets this many microseconds before sleeping, so that the "
                        "next decode step finds the worker awake (costs a core while steps come; for machines with "
                        "cores to spare, e.g. a GPU worker; default 0: sleep at once)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    _add_token_args(p)


def run_worker(args: argparse.Namespace) -> int:
    import torch

    from flotilla.runtime.loader import parse_device

    from .worker import Worker, WorkerConfig

    token = read_token(args)
    if args.spin_us < 0:
        raise FlotillaError(f"--spin-us must be >= 0 microseconds, got {args.spin_us}")
    host = port = sock = None
    if args.listen.startswith("fd:"):  # a listening socket the parent bound (serve --pp's local workers)
        try:
            sock = socket.socket(fileno=int(args.listen[3:]))
        except (ValueError, OSError) as e:
            raise FlotillaError(f"--listen {args.listen}: not an inherited listening socket ({e})") from None
    else:
        try:
            host, port = parse_address(args.listen)
        except ValueError as e:
            raise FlotillaError(f"--listen: {e}") from None
    model = Path(args.model).expanduser() if args.model else None
    if model is not None and not model.exists():
        raise FlotillaError(f"--model {model}: no such file or directory")
    server_ssl, client_ssl = _tls(args)
    # Set explicitly even when it is the default: the compute thread uses torch's thread count only
    # once it has been set (otherwise a thread other than the main one computes on one core).
    torch.set_num_threads(args.threads or torch.get_num_threads())
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else envs.cache_dir() / "worker"
    device = parse_device(args.device)
    check_devices([device], args.tp, "--device")
    config = WorkerConfig(token, device, cache, model, server_ssl, client_ssl, tp=args.tp, local=args.exit_with_parent)

    selector = SpinSelector(args.spin_us / 1e6)

    async def main() -> None:
        worker = Worker(config)
        selector.allowed = worker.idle  # no polling while the compute thread needs the GIL
        worker.on_step = selector.arm  # polling follows the steps
        try:
            bound = await worker.start(host, port, sock)
        except OSError as e:
            raise FlotillaError(f"cannot listen on {args.listen}: {e.strerror or e}") from None
        tp = f" x tp {args.tp}" if args.tp > 1 else ""
        print(f"flotilla worker: listening on {bound[0]}:{bound[1]} (device {config.device}{tp}, "
              f"model {model or 'pushed by the head'}, cache {cache}{', TLS' if server_ssl else ''})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.exit_with_parent:
            asyncio.create_task(_watch_parent(stop))
        await stop.wait()
        await worker.close()

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        runner.run(main())
    return 0


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    stop.set()


# --------------------------------------------------------------------------- serve --pp N

def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (several stages: processes on this machine, or workers on others)")
    g.add_argument("--pp", type=at_least_one, default=None,
                   help="pipeline stages (default: one per --hosts or --devices entry, else 1: the model runs in "
                        "this process; vLLM's --pipeline-parallel-size is the same)")
    g.add_argument("--pipeline-parallel-size", dest="pp", type=at_least_one, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    g.add_argument("--hosts", default=None,
                   help=f"the workers, one per stage in order: host[:port],… (default port {DEFAULT_PORT}; "
                        "--pp defaults to their number); without it, --pp N starts N workers on this machine")
    g.add_argument("--devices", default=None, metavar="D,D,…",
                   help="where the local workers run, one device per stage in order, repeats allowed: e.g. "
                        "cuda:0,cuda:0,cpu (two stages on one GPU and one on the CPU); gives --pp. Default: one "
                        "stage per GPU (cuda:0, cuda:1, …; with --tp M every M-th), else CPU processes")
    g.add_argument("--mps", default="auto", choices=["auto", "on", "off"],
                   help="local stages that share a GPU (--devices cuda:0,cuda:0): run them under NVIDIA MPS so that the "
                        "GPU does not switch between their processes at every hop (~0.15 ms each). auto (default): a "
                        "private MPS daemon where nvidia-cuda-mps-control is installed (one that runs already is "
                        "used), else without; on: fail without it; off: never")
    g.add_argument("--layers", default=None, help="layers per stage, e.g. 10,10,12 (default: by free memory and speed)")
    g.add_argument("--stage-timeout", type=float, default=60.0,
                   help="seconds a lost stage may take to come back before its requests fail (default 60); a "
                        "local worker (no --hosts) silent this long, at least 30 s, is killed and started again")
    g.add_argument("--wire-dtype", default=None, choices=list(WIRE_DTYPES),
                   help="activations between stages: fp16, bf16, or int8 (per-token scaled; half the bytes); default "
                        "fp16, but bf16 for Gemma 2 / 3, whose activations pass fp16's range")
    g.add_argument("--spin-us", type=int, default=None, metavar="US",
                   help="poll for the next message this many microseconds before sleeping: the head while steps "
                        "are in flight, and local workers (see `runtime worker --spin-us`); costs a core each while "
                        "the ring is busy. Default: local workers and the head poll when the ring leaves this "
                        "machine cores to spare (e.g. GPU workers), else 0")
    _add_token_args(g)


def is_pipeline(args: argparse.Namespace) -> bool:
    return ((getattr(args, "pp", None) or 1) > 1 or getattr(args, "hosts", None) is not None
            or getattr(args, "devices", None) is not None)


def parse_devices(text: str, pp: int) -> list[str]:
    """`--devices cuda:0,cuda:0,cpu` -> the devices of the local stages, checked against --pp
    (1, the default, takes the count from the list)."""
    from flotilla.runtime.loader import parse_device

    names = [d.strip() for d in text.split(",")]
    if not all(names):
        raise FlotillaError(f"--devices {text!r}: expected devices separated by commas, e.g. cuda:0,cuda:0,cpu")
    if pp > 1 and len(names) != pp:
        raise FlotillaError(f"--devices names {len(names)} devices, but --pp is {pp}")
    devices = []
    for name in names:
        try:
            devices.append(parse_device(name))
        except FlotillaError as e:
            raise FlotillaError(f"--devices {text!r}: {e}") from None
    return [str(d) for d in devices]


def check_devices(devices: list, tp: int, flag: str) -> None:
    """Every CUDA device (with the tp - 1 after it, under tensor parallelism) exists here."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in map(torch.device, devices):
        last = (d.index or 0) + tp - 1
        if d.type == "cuda" and last >= count:
            need = f"cuda:{d.index or 0}..cuda:{last} (--tp {tp})" if tp > 1 else str(d)
            raise FlotillaError(f"{flag}: {need} asked for; this host has {count} GPU{'s' * (count != 1)}")


def _same_worker(hosts: list[tuple[str, int]]) -> tuple | None:
    """The first two entries of --hosts that reach one address (localhost:7071 and 127.0.0.1:7071 do), or None.
    A name that does not resolve is compared as written (connecting to it says what is wrong)."""
    def addresses(host: str, port: int) -> set:
        try:
            return {(info[4][0], port) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            return {(host, port)}

    seen = [addresses(*h) for h in hosts]
    for i in range(len(hosts)):
        for j in range(i):
            if hosts[i] == hosts[j] or seen[i] & seen[j]:
                return hosts[j], hosts[i]
    return None


def pipeline_engine_from_args(args: argparse.Namespace, report=None):
    """Build the PipelineEngine that `runtime serve --pp N` serves (starting local workers when no
    --hosts are given); returns it, ready."""
    from flotilla.runtime.default_model import resolve_model_path
    from flotilla.runtime.engine_args import EngineArgs

    from .head import build_pipeline_engine
    from .local import LocalWorkers
    from .peer import LinkSettings
    from .pipeline import PipelineSettings

    report = report or say_line
    given = args.pp is not None  # else one stage per --hosts / --devices entry
    pp, tp = args.pp or 1, getattr(args, "tp", 1)
    if pp < 1 or tp < 1:
        raise FlotillaError(f"--pp and --tp must be at least 1, got --pp {pp} --tp {tp}")
    spin_us = getattr(args, "spin_us", None)
    if spin_us is not None and spin_us < 0:
        raise FlotillaError(f"--spin-us must be >= 0 microseconds, got {spin_us}")
    devices = None
    if getattr(args, "devices", None) is not None:
        if args.hosts:
            raise FlotillaError("--devices places local workers; with --hosts each `runtime worker` picks its own "
                                "--device")
        devices = parse_devices(args.devices, pp)
        check_devices(devices, tp, "--devices")
        pp = len(devices)
    hosts = None
    if args.hosts:  # every placement error before the model is resolved (which may download it)
        try:
            hosts = [parse_address(h, DEFAULT_PORT) for h in args.hosts.split(",")]
        except ValueError as e:
            raise FlotillaError(f"--hosts: {e}") from None
        if given and len(hosts) != pp:
            raise FlotillaError(f"--hosts names {len(hosts)} workers, but --pp is {pp}")
        same = _same_worker(hosts)
        if same is not None:
            a, b = (format_address(*h) for h in same)
            named = f"{a} twice" if a == b else f"one worker twice, as {a} and {b}"
            raise FlotillaError(f"--hosts names {named}; each stage needs a worker of its own "
                                f"(a second `runtime worker --listen HOST:PORT` on another port of that host)")
        pp = len(hosts)  # --pp may be left out: one stage per worker, as --devices counts its list
        if tp > 1:
            raise FlotillaError("--tp with --hosts: each worker's stage is as tensor-parallel as its own "
                                "`runtime worker --tp M` makes it")
    model = resolve_model_path(args.model)
    _, client_ssl = _tls(args)
    # what the model's config alone can refuse, before any local worker starts
    from flotilla.models.sources import open_source

    from .partition import parse_layers

    config = open_source(model).config
    num_layers = config.num_hidden_layers
    if args.stage_timeout <= 0:  # (PipelineSettings says it too, but only after the local workers started)
        raise FlotillaError(f"--stage-timeout must be > 0 seconds, got {args.stage_timeout:g}")
    wire_dtype = args.wire_dtype or ("bf16" if config.embed_scale is not None else "fp16")  # Gemma: bf16
    check_wire_dtype(wire_dtype)
    if pp > num_layers:
        raise FlotillaError(f"--pp {pp} is more stages than the model's {num_layers} layers")
    layers = parse_layers(args.layers, num_layers, pp) if args.layers else None
    local = None
    if hosts is not None:
        token = read_token(args)
    else:
        token = read_token(args, required=False) or secrets.token_hex(16).encode()
        local = LocalWorkers(pp, model, token, devices, log=report, tp=tp, spin_us=spin_us,
                             mps=getattr(args, "mps", "auto"), cores=getattr(args, "threads", None),
                             log_level=getattr(args, "worker_log_level", None))
        spin_us = local.spin_us
        polling = f"; they and the head poll {spin_us} µs before sleeping" if spin_us else ""
        report(f"starting {pp} local workers ({local.describe()}){polling}")
        hosts = local.start()
    settings = PipelineSettings(tuple(hosts), LinkSettings(token, client_ssl), tuple(layers) if layers else None,
                                wire_dtype, args.dtype, stage_timeout=args.stage_timeout, spin_us=spin_us or 0,
                                mps_advice=local is None)
    try:
        engine = build_pipeline_engine(model, EngineArgs.from_args(args), settings, report, device=args.device)
    except BaseException:
        if local is not None:
            local.stop()
        raise
    if local is not None:
        pipe = engine.executor.pipeline
        pipe.on_close.append(local.stop)
        # by then its requests have failed anyway; at least HANG_MIN_S, so that a short --stage-timeout does not
        # kill a worker that is only slow (a long step, a swap storm)
        local.watch(pipe.last_heard, max(pipe.settings.stage_timeout, HANG_MIN_S), pipe.stage_left_down)
    return engine
