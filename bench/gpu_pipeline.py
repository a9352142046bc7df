"""Pipeline stages on GPUs, and a mixed GPU + CPU ring, against pp=1 on the same GPU (issue 19).

    python bench/gpu_pipeline.py                          # a GPU machine: llama-3-8b INT4, written here
    python bench/gpu_pipeline.py --shape tiny --layers 6 --device cpu --rings "cpu,cpu;cpu,cpu,cpu" \\
        --kill-ring cpu,cpu --tokens 16                   # the same script on a CPU, in seconds

The checkpoint is a seeded random-weight INT4 one of a named shape, generated on the device
(flotilla/runtime/random_model.py; bench/random_checkpoint.py writes one alone), so nothing is carried or downloaded. Then, each in the same run:

    pp=1      the model in this process on --device, through the engine (CUDA graphs)
    rings     `--rings` lists local pipelines by their devices (the `--devices` of `runtime serve`):
              default cuda:0,cuda:0 (two stage processes on one GPU) and cuda:0,cpu,cuda:0 (a CPU
              stage between two GPU stages; the split comes from the workers' memory and speed
              probes, so the CPU gets few layers)

Per configuration: `--streams` concurrent greedy requests (EOS ignored) whose tokens must equal
pp=1's; single-stream decode tok/s (first token to last) and the aggregate decode tok/s of the
streams (from the moment every stream has its first token); per hop, the bytes a decode token
costs on a stage-to-stage hop (the workers count every frame) and the ring's time per hop:
(wall time per token of one stream - the stages' compute time per token) / hops, where a stage's
compute counts its input to the device, its layers and its output back in host memory; the
head's own time per token is in it too. Hops: head -> stage 0 -> ... -> last -> head, or, with
overlap, last -> stage 0 (the head off the ring). Each stage's step splits into prepare (sequence
mirror, inputs to the device), execute (the graph's launch; the last stage waits for its ids
there), output (a middle stage's wait for the device and copy to host) and send (encoding and
writing the frames), in µs a token; parked_steps counts decodes that reached stage 0 before their
input ids (the head was ahead of the ring, as overlap wants).

Every step runs at most --max-num-batched-tokens (16) tokens, and GPU stages replay the decode
graphs for prefill chunks too (one row per token, --graph-query-len 16): so every row of every
configuration goes through the same kernels with the same tile configs (the dequant-matmul picks
its tiles by row count, identical up to 16 rows), and token equality is exact on the GPU stages;
a CPU stage computes in fp32 with other kernels, so its ring is compared, not required equal.

Each ring runs once per value of `--micro-batches` (kept in flight; 0: one per stage that can
compute at once, stages on one GPU counting once), of `--spin-us` (the workers and the head poll
that long before sleeping; auto: as `runtime serve` decides, by the cores the ring leaves spare)
and of `--overlap` (on: with one micro-batch in flight, each decode goes out before the step
before it is read, its tokens fed to stage 0 by the last stage; off: `--no-overlap`), of `--lanes`
and of `--mps` (stages sharing a GPU under a private NVIDIA MPS daemon, as `runtime serve --mps`
starts: auto, on, off; the row's `mps_daemon` says whether one ran).

The fault test runs on the ring named by `--kill-ring` (one of --rings): its workers start
without the model, so the head pushes their shards (counted); after that ring's measurements,
while `--kill-streams` requests stream, the last stage's worker is killed with SIGKILL and
started again on the same port and cache directory; every request must finish with the tokens
of an undisturbed run (pp=1's), and the restarted worker must load from its cache (0 bytes
pushed). `--json` prints one JSON object per row.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flotilla.runtime.cuda_graphs import capture_sizes  # noqa: E402
from flotilla.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from flotilla.runtime.engine_args import EngineArgs  # noqa: E402
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec, plan_num_blocks  # noqa: E402
from flotilla.runtime.loader import load_model  # noqa: E402
from flotilla.runtime.model_runner import ModelRunner  # noqa: E402
from flotilla.runtime.pipeline.head import build_pipeline_engine  # noqa: E402
from flotilla.runtime.pipeline.local import LocalWorkers  # noqa: E402
from flotilla.runtime.pipeline.mps import mps_for  # noqa: E402
from flotilla.runtime.pipeline.peer import LinkSettings  # noqa: E402
from flotilla.runtime.pipeline.pipeline import PipelineSettings  # noqa: E402
from flotilla.runtime.random_model import write_random_checkpoint  # noqa: E402
from flotilla.runtime.sampling import SamplingParams  # noqa: E402
from flotilla.runtime.scheduler import SchedulerConfig  # noqa: E402

_ids = iter(range(1 << 30))


def run_requests(engine, prompts: list[list[int]], tokens: int, on_step=None) -> dict:
    """Greedy, EOS ignored: the tokens per prompt; the decode rate of all streams together (from
    when every stream has its first token), of the first stream (its first token to its last),
    and the whole run's seconds."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [f"r{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    begin = time.perf_counter()
    start = first = last = None
    counted = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.request_id == ids[0] and o.new_token_ids:
                last = time.perf_counter()
                first = first or last
            if start is not None:
                counted += len(o.new_token_ids)
        if start is None and all(out.values()):
            start = time.perf_counter()
        if on_step is not None:
            on_step(out)
    end = time.perf_counter()
    return {"tokens": [out[r] for r in ids], "multi_tok_s": counted / max(1e-9, end - (start or end)),
            "single_tok_s": (len(out[ids[0]]) - 1) / max(1e-9, (last or end) - (first or end)),
            "seconds": end - begin}


def local_engine(checkpoint: Path, device: str, args) -> LLMEngine:
    """pp=1: the model in this process, with decode graphs that also serve chunks of up to
    --graph-query-len tokens a sequence (as the pipeline's GPU stages are configured here)."""
    lm = load_model(checkpoint, device, None, with_tokenizer=False, progress=False)
    cfg = lm.config
    spec = KVCacheSpec(tuple(lm.model.stage.layers), lm.model.num_kv_heads, cfg.head_dim, lm.dtype, 16)
    num_blocks = plan_num_blocks(spec, lm.device, args.kv_cache_memory, max_blocks=args.streams * -(
        -args.max_model_len // 16) + 1)
    config = EngineConfig(num_blocks=num_blocks, block_size=16, max_model_len=args.max_model_len,
                          scheduler=SchedulerConfig(args.streams, args.max_num_batched_tokens),
                          enable_prefix_caching=False)  # as the rings (engine_args): every run computes
    runner = ModelRunner(lm.model, KVCache(spec, num_blocks, lm.device),
                         graph_sizes=capture_sizes(args.max_num_batched_tokens),
                         max_model_len=config.context_len, graph_query_len=args.graph_query_len)
    return LLMEngine(runner, config, None, (), cfg.vocab_size)


def engine_args(args, overlap: bool = True) -> EngineArgs:
    return EngineArgs(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.streams,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                      enable_prefix_caching=False, overlap=overlap)


def pipeline_settings(hosts, token: bytes, args, spin_us: int, micro_batches: int,
                      stage_timeout: float = 60.0) -> PipelineSettings:
    return PipelineSettings(tuple(hosts), LinkSettings(token), stage_timeout=stage_timeout,
                            graph_query_len=args.graph_query_len, spin_us=spin_us, micro_batches=micro_batches)


def measure(engine, prompts, args) -> dict:
    run_requests(engine, prompts, 8)  # warm-up: every graph bucket, every kernel
    run_requests(engine, prompts[:1], 8)
    single = run_requests(engine, prompts[:1], args.tokens)
    multi = run_requests(engine, prompts, args.tokens)
    return {"single_tok_s": single["single_tok_s"], "multi_tok_s": multi["multi_tok_s"], "tokens": multi["tokens"]}


def hops(engine, prompt, args) -> dict:
    """One stream of --tokens tokens: bytes per decode token on each stage-to-stage hop, and the
    ring's time per hop beside the stages' compute."""
    pipeline = engine.executor.pipeline
    pipeline.worker_stats(reset=True)
    run = run_requests(engine, [prompt], args.tokens)
    stats = pipeline.worker_stats()
    steps = args.tokens  # one step a token: the prompt's (one chunk of <= 16) and each decode
    compute = [s.compute_seconds / steps for s in stats]
    n_hops = len(stats) + 1  # head -> stage 0 -> ... -> last -> head
    if engine.overlap:
        n_hops = len(stats)  # last stage -> stage 0: the head is off the ring
    # a one-stage ring (`--rings cuda:0`: the worker process alone) has no stage-to-stage hop.
    # Through device lanes a stage's host no longer waits for its own GPU work only (the last stage
    # waits for the whole ring's), so the compute times overlap and the difference means nothing:
    # GPU timestamps measure those hops (bench/NOTES-gpu-pipeline.md)
    laned = any(s.lane_sent for s in stats)
    return {"bytes_per_token_hop": max((s.decode_bytes / max(1, s.decode_tokens) for s in stats[:-1]), default=0),
            "us_per_hop": None if laned else (run["seconds"] / steps - sum(compute)) / n_hops * 1e6,
            "stage_ms": [round(c * 1e3, 3) for c in compute], "ms_per_token": run["seconds"] / steps * 1e3,
            "lane_sent": [s.lane_sent for s in stats], "lane_refused": [s.lane_refused for s in stats],
            **breakdown(stats, steps, "")}


def breakdown(stats, steps: int, prefix: str) -> dict:
    """Each stage's µs a step in prepare / execute / output / send, and stage 0's parked steps."""
    parts = {f"{prefix}stage_{name}_us": [round(getattr(s, f"{name}_seconds") / steps * 1e6, 1) for s in stats]
             for name in ("prepare", "execute", "output", "send")}
    return {**parts, f"{prefix}parked_steps": stats[0].parked_steps}


def multi_steps(engine, prompts, args) -> dict:
    """The --streams run again, its steps' breakdown, per step of the whole run (prefill chunks
    and the ragged end, where streams admitted one by one finish one by one, included): wall ms
    and each stage's parts."""
    pipeline = engine.executor.pipeline
    pipeline.worker_stats(reset=True)
    run = run_requests(engine, prompts, args.tokens)
    stats = pipeline.worker_stats()
    steps = stats[0].steps
    if not steps:  # a one-stage ring forwards no steps to count them by: its breakdown is the single stream's
        return {}
    return {"multi_ms_per_step": run["seconds"] / steps * 1e3, "multi_steps": steps,
            "multi_stage_ms": [round(s.compute_seconds / steps * 1e3, 3) for s in stats],
            **breakdown(stats, steps, "multi_")}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(x == y for a, b in zip(ref, got) for x, y in zip(a, b))
    return {"identical": sum(a == b for a, b in zip(ref, got)), "positions_equal": same / sum(map(len, ref))}


# ------------------------------------------------------------------------------------ the fault test

class Worker:
    """`runtime worker` without the model (the head pushes its shards), on a fixed port once known."""

    def __init__(self, device: str, cache: Path, token: bytes, port: int = 0, log=print, spin_us: int = 0,
                 extra_env: dict | None = None):
        env = dict(os.environ, FLOTILLA_TOKEN=token.decode(), PYTHONPATH=str(ROOT), **(extra_env or {}))
        cmd = [sys.executable, "-m", "flotilla.runtime.cli", "worker", "--listen", f"127.0.0.1:{port}",
               "--device", device, "--cache-dir", str(cache), "--exit-with-parent", "--log-level", "warning",
               "--spin-us", str(spin_us)]
        self.device, self.cache, self.token, self.log, self.spin_us = device, cache, token, log, spin_us
        self.extra_env = extra_env
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1)
        self.port, self._ready = port, threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            m = re.search(r"listening on \S+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self._ready.set()
            self.log(f"[worker {self.device} {self.port}] {line.rstrip()}")
        self._ready.set()

    def wait(self, timeout: float = 300) -> "Worker":
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"worker on {self.device} did not start")
        return self

    def restart(self) -> "Worker":
        return Worker(self.device, self.cache, self.token, self.port, self.log, self.spin_us, self.extra_env).wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class PushedWorkers:
    """The fault test's workers: `Worker`s without the model, in a private temporary directory."""

    def __init__(self, devices: list[str], token: bytes, log, spin_us: int, mps: str):
        self.tmp = Path(tempfile.mkdtemp(prefix="flotilla-kill-"))
        self.spin_us = spin_us
        self.mps = mps_for(devices, mps, log)  # as LocalWorkers: stages sharing a GPU under MPS
        self.workers = []
        try:
            for i, d in enumerate(devices):
                self.workers.append(Worker(d, self.tmp / f"cache-{i}", token, log=log, spin_us=spin_us,
                                           extra_env=self.mps.env_for(d)))
        except BaseException:
            self.stop()
            raise

    def start(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", w.wait().port) for w in self.workers]

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.mps.stop()


def kill_and_restart(engine, workers: PushedWorkers, prompts, reference, args) -> dict:
    """Stream `prompts`; once each has a quarter of its tokens, SIGKILL the last stage's worker and
    start it again on its port and cache directory."""
    pipeline = engine.executor.pipeline
    pushed = [r.received_bytes for r in pipeline.loaded]
    victim = len(workers.workers) - 1
    state = {"killed_at": None, "restarted_in": None}
    rewinds = engine.num_rewinds

    def maybe_kill(out):
        if state["killed_at"] is None and min(map(len, out.values())) >= args.tokens // 4:
            state["killed_at"] = min(map(len, out.values()))
            w = workers.workers[victim]
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(30)
            t = time.perf_counter()
            workers.workers[victim] = w.restart()
            state["restarted_in"] = time.perf_counter() - t

    run = run_requests(engine, prompts, args.tokens, on_step=maybe_kill)
    back = pipeline.loaded[victim]
    stats = pipeline.worker_stats()
    return {"row": "kill", "devices": ",".join(w.device for w in workers.workers), "streams": len(prompts),
            "tokens": args.tokens, "killed_after_tokens": state["killed_at"],
            "worker_restart_s": state["restarted_in"], "rewinds": engine.num_rewinds - rewinds,
            **agreement(reference, run["tokens"]), "pushed_bytes_first_load": pushed,
            "pushed_bytes_after_restart": back.received_bytes,
            "restarted_worker_shard_bytes_received": stats[victim].shard_bytes_received,
            "restarted_worker_weights_from": back.source, "seconds": run["seconds"]}


def ring_rows(checkpoint: Path, ring: list[str], spin_us: int | None, micro_batches: int, overlap: bool, kill: bool,
              prompts, base: dict, args, log) -> list[dict]:
    """Measure one local pipeline; with `kill` (the --kill-ring), its workers get their weights
    pushed and the fault test follows on the same engine."""
    token = secrets.token_hex(16).encode()
    local = LocalWorkers(len(ring), checkpoint, token, ring, log=log, spin_us=spin_us, mps=args.mps)
    workers, engine = local, None
    try:
        if kill:
            workers = PushedWorkers(ring, token, log, local.spin_us, args.mps)
        hosts = workers.start()
        t = time.perf_counter()
        stage_timeout = 600 if kill else 60
        settings = pipeline_settings(hosts, token, args, local.spin_us, micro_batches, stage_timeout)
        engine = build_pipeline_engine(checkpoint, engine_args(args, overlap), settings, log, with_tokenizer=False)
        pipeline = engine.executor.pipeline
        row = {"row": f"pp{len(ring)}", "devices": ",".join(ring), "setup_s": time.perf_counter() - t,
               "spin_us": local.spin_us, "micro_batches": pipeline.depth, "overlap": engine.overlap,
               "mps_used": workers.mps.used, "mps_daemon": workers.mps.daemon is not None,
               "split": ",".join(str(s.end - s.start) for s in pipeline.stages),
               **measure(engine, prompts, args)}
        row.update(hops(engine, prompts[0], args), **multi_steps(engine, prompts, args),
                   steps_ahead=engine.num_ahead, steps_dropped=engine.num_dropped)
        row.update(agreement(base["tokens"], row["tokens"]), single_vs_pp1=row["single_tok_s"] / base["single_tok_s"],
                   multi_vs_pp1=row["multi_tok_s"] / base["multi_tok_s"])
        rows = [row]
        if kill:
            n = args.kill_streams
            rows.append(kill_and_restart(engine, workers, prompts[:n], base["tokens"][:n], args))
        return rows
    finally:
        if engine is not None:
            engine.close()
        workers.stop()


# ----------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--checkpoint", default=None, help="where to write it (default: a temporary directory)")
    ap.add_argument("--device", default="cuda:0" if cuda else "cpu", help="pp=1's device, and where weights are made")
    ap.add_argument("--rings", default="cuda:0,cuda:0;cuda:0,cpu,cuda:0" if cuda else "cpu,cpu;cpu,cpu,cpu",
                    help="local pipelines by device, ';' between them")
    ap.add_argument("--kill-ring", default="cuda:0,cuda:0" if cuda else "cpu,cpu",
                    help="the ring of --rings whose workers get their weights pushed, then the fault test ('': none)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--kill-streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16)
    ap.add_argument("--graph-query-len", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="2GiB", help="per stage (and for pp=1)")
    ap.add_argument("--micro-batches", default="0", help="comma-separated: micro-batches in flight (0: automatic); "
                    "each ring runs once per value")
    ap.add_argument("--spin-us", default="auto", help="comma-separated: µs the workers and the head poll before "
                    "sleeping, or auto; each ring runs once per value")
    ap.add_argument("--overlap", default="on", help="comma-separated on/off: decodes sent before the step before "
                    "is read (with one micro-batch in flight; `runtime serve --no-overlap`); each ring runs once per value")
    ap.add_argument("--lanes", default="on", help="comma-separated on/off: device lanes between the stages of one "
                    "host (runtime/pipeline/lane.py; FLOTILLA_LANES=0 is off); each ring runs once per value")
    ap.add_argument("--mps", default="auto", help="comma-separated auto/on/off: stages that share a GPU under a "
                    "private NVIDIA MPS daemon (runtime serve --mps; runtime/pipeline/mps.py); each ring runs once "
                    "per value")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="the workers' and the head's log lines")
    args = ap.parse_args(argv)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else (lambda line: None)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.json:
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)

    t = time.perf_counter()
    tmp = None if args.checkpoint else tempfile.TemporaryDirectory(prefix="flotilla-random-")
    checkpoint = write_random_checkpoint(args.shape, args.checkpoint or Path(tmp.name) / args.shape, 4, 128, 0,
                                         args.device, args.layers)
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    emit({"row": "checkpoint", "shape": args.shape, "bytes": size, "seconds": time.perf_counter() - t})
    rng = random.Random(0)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]

    engine = local_engine(checkpoint, args.device, args)
    base = measure(engine, prompts, args)
    emit({"row": "pp1", "devices": args.device, "split": "-", **base, "identical": args.streams,
          "positions_equal": 1.0})
    del engine
    if cuda:
        torch.cuda.empty_cache()

    spins = [None if v == "auto" else int(v) for v in args.spin_us.split(",")]
    batches = [int(v) for v in args.micro_batches.split(",")]
    overlaps = [{"on": True, "off": False}[v] for v in args.overlap.split(",")]
    lanes = args.lanes.split(",")
    mpss = args.mps.split(",")
    for ring in [r.split(",") for r in args.rings.split(";") if r]:
        killed = False
        for spin in spins:
            for mb in batches:
                for overlap in overlaps:
                    for lane, mps in itertools.product(lanes, mpss):
                        os.environ["FLOTILLA_LANES"] = "1" if lane == "on" else "0"  # the workers' environment
                        kill = ",".join(ring) == args.kill_ring and not killed  # the fault test once, on the first variant
                        killed |= kill
                        for row in ring_rows(checkpoint, ring, spin, mb, overlap, kill, prompts, base,
                                             argparse.Namespace(**{**vars(args), "mps": mps}), log):
                            emit({**row, "lanes": lane, "mps": mps})
    if not args.json:
        print_tables(rows, args)
    return 0


def print_tables(rows: list[dict], args) -> None:
    ck = rows[0]
    print(f"{ck['shape']} INT4 g128, random weights ({ck['bytes'] / 2**30:.2f} GiB written in {ck['seconds']:.0f}s); "
          f"{args.streams} streams x {args.tokens} tokens, prompts of {args.prompt_len}; steps of <= "
          f"{args.max_num_batched_tokens} tokens")
    print(f"{'config':>6s} {'devices':>18s} {'split':>9s} {'single tok/s':>12s} {'x pp1':>6s} "
          f"{f'{args.streams}-stream tok/s':>15s} {'x pp1':>6s} {'B/tok/hop':>9s} {'us/hop':>7s} {'identical':>9s} "
          f"{'mb':>2s} {'spin µs':>7s} {'overlap':>7s} {'lanes':>5s} {'mps':>4s}")
    for r in rows:
        if not r["row"].startswith("pp"):
            continue
        x1 = f"{r['single_vs_pp1']:.2f}" if "single_vs_pp1" in r else ""
        xn = f"{r['multi_vs_pp1']:.2f}" if "multi_vs_pp1" in r else ""
        b = f"{r['bytes_per_token_hop']:.0f}" if "bytes_per_token_hop" in r else "-"
        us = f"{r['us_per_hop']:.0f}" if r.get("us_per_hop") is not None else "-"
        print(f"{r['row']:>6s} {r['devices']:>18s} {r['split']:>9s} {r['single_tok_s']:12.1f} {x1:>6s} "
              f"{r['multi_tok_s']:15.1f} {xn:>6s} {b:>9s} {us:>7s} {r['identical']:>4d}/{args.streams:<4d} "
              f"{r.get('micro_batches', '-'):>2} {r.get('spin_us', '-'):>7} {str(r.get('overlap', '-')):>7} "
              f"{r.get('lanes', '-'):>5} {r.get('mps', '-'):>4}")
    for r in rows:
        if r["row"] == "kill":
            print(f"kill -9 of the last stage ({r['devices']}) after {r['killed_after_tokens']} tokens a stream, "
                  f"restarted in {r['worker_restart_s']:.1f}s: {r['identical']}/{r['streams']} streams identical to "
                  f"pp=1 ({r['positions_equal']:.1%} of positions), {r['rewinds']} rewind(s); shards pushed at "
                  f"first load {r['pushed_bytes_first_load']} B, after the restart "
                  f"{r['pushed_bytes_after_restart']} B (worker counter "
                  f"{r['restarted_worker_shard_bytes_received']} B; weights from {r['restarted_worker_weights_from']})")


if __name__ == "__main__":
    sys.exit(main())
