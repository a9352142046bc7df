"""Single-stream decode on the CPU: the engine (per kernel) against transformers and llama.cpp,
all in the same run.

    python3 bench/cpu_decode.py                      # the table
    python3 bench/cpu_decode.py --json --tokens 128  # one JSON object per row

Rows (SmolLM2-135M; greedy, EOS ignored, the same chat prompt token ids everywhere):

    engine dense      INT4 checkpoint, FLOTILLA_KERNEL=dense: dequantized fp32 weights and the
                      lm_head through MKL
    engine cpu        INT4 checkpoint, flotilla's compiled W4 kernel (the registry's choice on
                      x86), lm_head in its exact compact form (what the runtime does by default)
    engine cpu, fp32 head   the same with the lm_head through MKL
    engine fp32       the GGUF dequantized to fp32 (MKL layers, compact lm_head)
    transformers      fp32 generate, eager, from the same GGUF
    llama.cpp         llama-cpp-python on the same GGUF (Q4_1 layers, Q8_0 embedding)

Decode tok/s = (tokens - 1) / (time of the last token - time of the first), the best of
--repeats. `vs llama.cpp` is the ratio to the llama.cpp row; `agree` is how many leading tokens
equal the first row's. The INT4 checkpoint is made once by RTN from the GGUF
(bench/rtn_checkpoint.py; group 64, symmetric) and cached under $FLOTILLA_CACHE_DIR/bench/.
llama.cpp runs in a subprocess: where its CPU "extra buffer" path (weight repacking, AMX)
crashes, as on VMs that do not enable AMX tile state, it is rerun without it and the row says so.
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
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def int4_checkpoint(gguf: Path, group_size: int) -> Path:
    from bench.rtn_checkpoint import write_rtn_checkpoint
    from flotilla.envs import cache_dir

    path = cache_dir() / "bench" / f"smollm2-135m-rtn-w4g{group_size}s"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rtn_checkpoint(gguf, path, 4, group_size, True)
    return path


def engine_row(name: str, path: Path, kernel: str | None, prompt: list[int], tokens: int, repeats: int,
               fp32_head: bool = False) -> dict:
    import torch

    from flotilla.kernels.registry import ENV_KERNEL
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    if kernel:
        os.environ[ENV_KERNEL] = kernel
    try:
        lm = load_model(path, "cpu", "float32", progress=False)
        engine = build_engine(lm, EngineArgs(kv_cache_memory="128MiB", max_num_seqs=1))
    finally:
        os.environ.pop(ENV_KERNEL, None)
    if fp32_head:
        lm.model.freeze()  # no logits kernel: the plain fp32 lm_head
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best, out = 0.0, []
    with torch.inference_mode():
        for r in range(repeats):
            engine.add_request(f"r{r}", prompt, params)
            stamps, out = [], []
            while engine.has_unfinished():
                for o in engine.step():
                    stamps.append(time.perf_counter())
                    out += o.new_token_ids
            best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
            engine.block_manager.pool.reset_prefix_cache()
    return {"impl": name, "tok_s": best, "tokens_out": out}


def transformers_row(gguf: Path, prompt: list[int], tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

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
    return {"impl": "transformers fp32 generate (eager)", "tok_s": best, "tokens_out": out}


LLAMA_WORKER = r"""
import json, sys, time
import llama_cpp
path, tokens, repeats, threads, no_extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
ids = json.loads(sys.argv[6])
if no_extra:
    base = llama_cpp.llama_model_default_params
    def params():
        p = base()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params
llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
best, out = 0.0, []
for _ in range(repeats):
    t, out = [], []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        t.append(time.perf_counter())
        out.append(int(tok))
        if len(t) == tokens:
            break
    best = max(best, (len(t) - 1) / (t[-1] - t[0]))
print(json.dumps({"tok_s": best, "tokens_out": out}))
"""


def llama_cpp_row(gguf: Path, prompt: list[int], tokens: int, repeats: int, threads: int) -> dict | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    proc = None
    for no_extra, note in ((False, ""), (True, ", no repack: AMX crashed")):
        proc = subprocess.run([sys.executable, "-c", LLAMA_WORKER, str(gguf), str(tokens), str(repeats), str(threads),
                               "1" if no_extra else "0", json.dumps(prompt)], capture_output=True, text=True)
        if proc.returncode == 0:
            return {"impl": f"llama.cpp Q4_1 (llama-cpp-python{note})", **json.loads(proc.stdout.strip().splitlines()[-1])}
    return {"impl": "llama.cpp Q4_1 (llama-cpp-python)", "tok_s": None,
            "error": (proc.stderr.strip() or f"exit code {proc.returncode}")[-200:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--checkpoint", type=Path, help="an INT4 checkpoint (default: made once from the GGUF)")
    ap.add_argument("--skip", action="append", default=[], help="skip rows: dense, fp32-head, fp32, transformers, llama.cpp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from flotilla.kernels.cpu import available
    from flotilla.models.tokenizer import load_tokenizer
    from flotilla.runtime.default_model import default_model_path

    gguf = default_model_path()
    int4 = args.checkpoint or int4_checkpoint(gguf, args.group_size)
    prompt = load_tokenizer(gguf).apply_chat_template([{"role": "user", "content": PROMPT}])
    n, r = args.tokens, args.repeats
    rows = []
    if "dense" not in args.skip:
        rows.append(engine_row("engine INT4, dense kernel (fp32 MKL)", int4, "dense", prompt, n, r))
    if available():
        rows.append(engine_row("engine INT4, cpu kernel, compact lm_head", int4, "cpu", prompt, n, r))
        if "fp32-head" not in args.skip:
            rows.append(engine_row("engine INT4, cpu kernel, fp32 lm_head", int4, "cpu", prompt, n, r, fp32_head=True))
    if "fp32" not in args.skip:
        rows.append(engine_row("engine fp32 (the GGUF dequantized)", gguf, None, prompt, n, r))
    if "transformers" not in args.skip:
        rows.append(transformers_row(gguf, prompt, n, r))
    if "llama.cpp" not in args.skip:
        row = llama_cpp_row(gguf, prompt, n, r, args.threads)
        if row is not None:
            rows.append(row)
    peer = next((x["tok_s"] for x in rows if x["impl"].startswith("llama.cpp") and x.get("tok_s")), None)
    first = rows[0].get("tokens_out") or []
    for x in rows:
        got = x.pop("tokens_out", None) or []
        x["agree"] = next((i for i, (a, b) in enumerate(zip(got, first)) if a != b), min(len(got), len(first)))
        x.update(threads=args.threads, tokens=n, vs_llama_cpp=x["tok_s"] / peer if peer and x.get("tok_s") else None)
    if args.json:
        for x in rows:
            print(json.dumps(x))
        return 0
    print(f"SmolLM2-135M single-stream decode: {n} tokens, {args.threads} threads, best of {r}; INT4 = {int4.name}")
    print(f"{'implementation':70s} {'tok/s':>7s} {'vs llama.cpp':>12s} {'agree':>7s}")
    for x in rows:
        tps = f"{x['tok_s']:.1f}" if x.get("tok_s") else "failed"
        ratio = f"{x['vs_llama_cpp']:.2f}x" if x.get("vs_llama_cpp") else "-"
        print(f"{x['impl']:70s} {tps:>7s} {ratio:>12s} {x['agree']:>4d}/{n}")
        if x.get("error"):
            print(f"    {x['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
