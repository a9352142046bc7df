"""CPU decode and prefill: what `runtime chat` runs against llama.cpp on the same files, one run.

    python3 -P bench/cpu_decode.py                       # the table
    python3 -P bench/cpu_decode.py --json                # one JSON object per row
    python3 -P bench/cpu_decode.py --skip int4,transformers --tokens 64

Rows (SmolLM2-135M-Instruct; greedy, EOS ignored; the same prompt token ids everywhere):

    default GGUF          exactly what `runtime chat` with no MODEL runs: the embedded Q4_1 GGUF in its
                          own blocks (AVX-512 kernels where the CPU has them), then the same with the
                          AVX2 build forced (FLOTILLA_CPU_ISA=avx2)
    llama.cpp             llama-cpp-python on the same file, 2 threads
    Q4_K_M GGUF           the same model requantized by llama.cpp's own quantizer (bench/gguf_files.py),
                          flotilla native (AVX-512, AVX2) against llama.cpp on that file
    INT4 checkpoint       RTN group 64 from the GGUF (bench/rtn_checkpoint.py), the compiled W4 kernel
    fp32                  the GGUF dequantized to fp32 (what the runtime did before it ran GGUF natively)
    transformers          fp32 generate, eager, from the same GGUF
    peak RSS              VmHWM of a `runtime generate` subprocess on the default model with a
                          2048-token context (--max-model-len 2048; the default KV cache, which is
                          sized for that context), and what of that the KV cache held

decode tok/s = (tokens - 1) / (time of the last token - time of the first), best of --repeats.
prefill tok/s = 512 / time to the first token of a 512-token prompt (prefix cache cleared), best
of --repeats; llama.cpp: 512 / the time of llama_decode over the same ids in one batch.
`vs llama.cpp` compares with the llama.cpp row of the same file. Every engine and llama.cpp row
runs in its own process (so forcing an ISA or measuring memory touches nothing else); each row
names the ISA its kernels ran on, and the header the CPU. `agree` counts leading tokens equal to
the default row's (the same file) or llama.cpp's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]  # not bench/: its kernels.py would shadow the `kernels` package transformers probes for

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PREFILL_TOKENS = 512


def int4_checkpoint(gguf: Path, group_size: int) -> Path:
    from bench.rtn_checkpoint import write_rtn_checkpoint
    from flotilla.envs import cache_dir

    path = cache_dir() / "bench" / f"smollm2-135m-rtn-w4g{group_size}s"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rtn_checkpoint(gguf, path, 4, group_size, True)
    return path


def prompt_ids(gguf: Path) -> tuple[list[int], list[int]]:
    """The chat prompt's ids, and PREFILL_TOKENS ids of plain text for the prefill rows."""
    from flotilla.models.tokenizer import load_tokenizer

    tok = load_tokenizer(gguf)
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    text = " ".join(f"Paragraph {i}: the keeper climbed the stairs and lit the lamp at dusk." for i in range(80))
    long = tok.encode(text)[:PREFILL_TOKENS]
    assert len(long) == PREFILL_TOKENS
    return chat, long


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


# ------------------------------------------------------------------------------ engine rows

def engine_measure(model: str, native: bool, chat: list[int], long: list[int], tokens: int, repeats: int) -> dict:
    """Runs in a worker process: decode and prefill through the engine."""
    import torch

    from flotilla.kernels.cpu import build
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.host_memory import lean_cpu_load
    from flotilla.runtime.loader import LoadedModel, load_model
    from flotilla.runtime.sampling import SamplingParams

    with lean_cpu_load("cpu"):  # glibc as `runtime chat` sets it around its load
        if native:
            lm = load_model(model, "cpu", "float32", with_tokenizer=False, progress=False)
        else:  # the GGUF dequantized to fp32, as the runtime loaded GGUF files before
            source = open_source(model, native_gguf=False)
            lm = LoadedModel(Path(model), source.config, load_stage(source), None, torch.device("cpu"), torch.float32)
    engine = build_engine(lm, EngineArgs(kv_cache_memory="128MiB", max_num_seqs=1))
    best_decode, best_prefill, out = 0.0, 0.0, []
    with torch.inference_mode():
        for r in range(repeats):
            engine.add_request(f"d{r}", chat, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            stamps, out = [], []
            while engine.has_unfinished():
                for o in engine.step():
                    stamps.append(time.perf_counter())
                    out += o.new_token_ids
            best_decode = max(best_decode, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
            engine.block_manager.pool.reset_prefix_cache()
            start = time.perf_counter()
            engine.add_request(f"p{r}", long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            best_prefill = max(best_prefill, len(long) / (time.perf_counter() - start))
            engine.block_manager.pool.reset_prefix_cache()
    ext = build.load()
    return {"decode_tok_s": best_decode, "prefill_tok_s": best_prefill, "tokens_out": out,
            "isa": ext.isa() if ext is not None else "none (dense fallback)"}


def engine_row(impl: str, model: Path, args, chat, long, isa: str | None = None, native: bool = True) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FLOTILLA_CPU_ISA", None)
    if isa:
        env["FLOTILLA_CPU_ISA"] = isa
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", json.dumps(
        {"model": str(model), "native": native, "chat": chat, "long": long, "tokens": args.tokens,
         "repeats": args.repeats, "threads": args.threads})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"impl": impl, "file": model.name, "error": (proc.stderr.strip() or f"exit {proc.returncode}")[-300:]}
    return {"impl": impl, "file": model.name, **json.loads(proc.stdout.strip().splitlines()[-1])}


def worker(spec: str) -> int:
    import torch

    s = json.loads(spec)
    torch.set_num_threads(s["threads"])
    print(json.dumps(engine_measure(s["model"], s["native"], s["chat"], s["long"], s["tokens"], s["repeats"])))
    return 0


# ------------------------------------------------------------------------------ llama.cpp

LLAMA_WORKER = r"""
import json, sys, time
import llama_cpp
path, tokens, repeats, threads, no_extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
chat, long = json.loads(sys.argv[6]), json.loads(sys.argv[7])
if no_extra:
    base = llama_cpp.llama_model_default_params
    def params():
        p = base()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params
llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=len(long),
                      n_ubatch=len(long), verbose=False)
decode, prefill, out = 0.0, 0.0, []
for _ in range(repeats):
    t, out = [], []
    for tok in llm.generate(chat, temp=0.0, top_k=1, reset=True):
        t.append(time.perf_counter())
        out.append(int(tok))
        if len(t) == tokens:
            break
    decode = max(decode, (len(t) - 1) / (t[-1] - t[0]))
    llm.reset()
    start = time.perf_counter()
    llm.eval(long)
    prefill = max(prefill, len(long) / (time.perf_counter() - start))
info = llama_cpp.llama_print_system_info().decode()
isa = "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "?"
print(json.dumps({"decode_tok_s": decode, "prefill_tok_s": prefill, "tokens_out": out, "isa": isa}))
"""


def llama_cpp_row(model: Path, args, chat, long) -> dict | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    proc = None
    for no_extra, note in ((False, ""), (True, ", no repack: AMX crashed")):
        proc = subprocess.run([sys.executable, "-c", LLAMA_WORKER, str(model), str(args.tokens), str(args.repeats),
                               str(args.threads), "1" if no_extra else "0", json.dumps(chat), json.dumps(long)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            return {"impl": f"llama.cpp (llama-cpp-python{note})", "file": model.name,
                    **json.loads(proc.stdout.strip().splitlines()[-1])}
    return {"impl": "llama.cpp (llama-cpp-python)", "file": model.name,
            "error": (proc.stderr.strip() or f"exit code {proc.returncode}")[-300:]}


# ------------------------------------------------------------------------------ other rows

def transformers_row(gguf: Path, chat: list[int], tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([chat])

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t, self.ids, self.prompt_seen = [], [], False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.t.append(time.perf_counter())
            self.ids += value.view(-1).tolist()

        def end(self):
            pass

    best, out = 0.0, []
    with torch.inference_mode():
        for _ in range(repeats):
            s = Stamps()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, streamer=s, pad_token_id=2)
            best, out = max(best, (len(s.t) - 1) / (s.t[-1] - s.t[0])), s.ids
    return {"impl": "transformers fp32 generate (eager)", "file": gguf.name, "decode_tok_s": best,
            "tokens_out": out, "isa": f"torch {torch.backends.cpu.get_cpu_capability()}"}


RSS_WORKER = r"""
import sys
from flotilla.server.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
hwm = next(l for l in open("/proc/self/status").read().splitlines() if l.startswith("VmHWM"))
print("VMHWM_KB", int(hwm.split()[1]), rc)
"""


def rss_row(args) -> dict:
    """Peak RSS of `runtime generate` (no MODEL: the embedded default, default options) with a
    2048-token context."""
    cli = ["generate", "--prompt", PROMPT, "--chat", "--max-tokens", "32", "--max-model-len", "2048"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FLOTILLA_CPU_ISA", None)
    proc = subprocess.run([sys.executable, "-c", RSS_WORKER, *cli], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VMHWM_KB")), None)
    if proc.returncode != 0 or line is None:
        return {"impl": "peak RSS of runtime generate", "error": (proc.stderr.strip() or "no output")[-300:]}
    kv = next((ln for ln in proc.stderr.splitlines() if ln.startswith("KV cache:")), "")
    return {"impl": "peak RSS of runtime generate", "file": "(default)", "peak_rss_mb": int(line.split()[1]) / 1024,
            "command": "runtime " + " ".join(cli), "kv_cache": kv}


# ------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma-separated rows to skip: avx2, q4km, int4, fp32, transformers, "
                                                "llama.cpp, rss")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    skip = set(filter(None, args.skip.split(",")))

    import torch

    torch.set_num_threads(args.threads)
    from flotilla.runtime.default_model import default_model_path

    gguf = default_model_path()
    chat, long = prompt_ids(gguf)
    rows = [engine_row("flotilla, runtime chat default (GGUF native)", gguf, args, chat, long)]
    if "avx2" not in skip:
        rows.append(engine_row("flotilla, GGUF native, AVX2 forced", gguf, args, chat, long, isa="avx2"))
    if "llama.cpp" not in skip:
        rows.append(llama_cpp_row(gguf, args, chat, long))
    if "q4km" not in skip:
        from bench.gguf_files import requantized_gguf

        q4km = requantized_gguf(gguf, "Q4_K_M")
        rows.append(engine_row("flotilla, GGUF native", q4km, args, chat, long))
        if "avx2" not in skip:
            rows.append(engine_row("flotilla, GGUF native, AVX2 forced", q4km, args, chat, long, isa="avx2"))
        if "llama.cpp" not in skip:
            rows.append(llama_cpp_row(q4km, args, chat, long))
    if "int4" not in skip:
        rows.append(engine_row("flotilla, INT4 RTN g64 checkpoint (W4 kernel)", int4_checkpoint(gguf, args.group_size),
                               args, chat, long))
    if "fp32" not in skip:
        rows.append(engine_row("flotilla, the GGUF dequantized to fp32", gguf, args, chat, long, native=False))
    if "transformers" not in skip:
        rows.append(transformers_row(gguf, chat, args.tokens, args.repeats))
    rows = [r for r in rows if r is not None]
    finish(rows, gguf.name, args)
    if "rss" not in skip:
        rows.append(rss_row(args))
    emit(rows, args)
    return 0


def finish(rows: list[dict], default_file: str, args) -> None:
    """Ratios to the llama.cpp row of the same file; `agree`: leading tokens equal to the first
    row of the same file (of the default file for a checkpoint; the first row and llama.cpp's
    compare with each other)."""
    peers = {r["file"]: r for r in rows if r["impl"].startswith("llama.cpp") and "error" not in r}
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r.get("file"), r)
    tokens = {id(r): r.get("tokens_out") or [] for r in rows}
    for r in rows:
        head = first.get(r.get("file")) or first[default_file]
        ref = peers.get(r.get("file")) if r is head else head
        if r.get("file") not in first or (head is r and ref is None):
            ref = first[default_file]
        got, want = tokens[id(r)], tokens[id(ref)] if ref is not None else []
        r.pop("tokens_out", None)
        r["agree"] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        peer = peers.get(r.get("file"))
        for key in ("decode_tok_s", "prefill_tok_s"):
            ok = peer is not None and peer is not r and r.get(key) and peer.get(key)
            r[f"{key[:-6]}_vs_llama_cpp"] = r[key] / peer[key] if ok else None
        r.update(threads=args.threads, tokens=args.tokens, prefill_tokens=PREFILL_TOKENS, cpu=cpu_name())


def emit(rows: list[dict], args) -> None:
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"SmolLM2-135M-Instruct on {cpu_name()}, {args.threads} threads: decode {args.tokens} tokens, "
          f"prefill {PREFILL_TOKENS}, best of {args.repeats}")
    head = f"{'implementation':48s} {'file':40s} {'isa':7s} {'decode':>8s} {'vs l.cpp':>8s} {'prefill':>8s} {'vs l.cpp':>8s} {'agree':>6s}"
    print(head)

    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    for r in rows:
        if "peak_rss_mb" in r:
            print(f"{r['impl']:48s} {r['file']:40s} {'':7s} peak {r['peak_rss_mb']:.0f} MB  ({r['command']})")
            continue
        if "error" in r:
            print(f"{r['impl']:48s} {r.get('file', ''):40s} failed: {r['error']}")
            continue
        ratio_d = num(r.get("decode_vs_llama_cpp"), ".2f") + ("x" if r.get("decode_vs_llama_cpp") else "")
        ratio_p = num(r.get("prefill_vs_llama_cpp"), ".2f") + ("x" if r.get("prefill_vs_llama_cpp") else "")
        print(f"{r['impl']:48s} {r['file']:40s} {r.get('isa', ''):7s} {num(r.get('decode_tok_s'), '8.1f'):>8s} "
              f"{ratio_d:>8s} {num(r.get('prefill_tok_s'), '8.1f'):>8s} {ratio_p:>8s} {r.get('agree', 0):>6d}")


if __name__ == "__main__":
    sys.exit(main())
