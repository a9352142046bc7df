"""Single-stream decode speed on the CPU: flotilla against transformers and llama.cpp, one run.

    python bench/cpu_decode.py                      # SmolLM2-135M: our INT4 and fp32, transformers
                                                    # fp32 generate, llama.cpp (llama-cpp-python)
    python bench/cpu_decode.py --tokens 256 --threads 2 --json

Every row generates --tokens tokens greedily after the same short prompt (EOS ignored) and
reports decode tok/s = (tokens - 1) / (time of the last token - time of the first), the best of
--repeats runs. Ratios are against llama.cpp on the same GGUF file (Q4_1 layers, Q8_0
embedding), or against transformers when llama.cpp is not installed.

Our INT4 model is SmolLM2 quantized RTN 4-bit, group 32, GPTQ layout (tests/rtn_int4.py; the
`quantize` command makes the same format), loaded through the kernel registry, whose chosen
kernel is named in the row. llama.cpp runs in a subprocess so that a crash cannot take the
benchmark down; if its CPU "extra buffer" (weight repacking, AMX) path crashes, as it does on
VMs that do not enable AMX tile state, it is retried without it and the row says so.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(path, tokens: int, repeats: int, label: str) -> dict:
    import torch

    from flotilla.models.linear import QuantLinear
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams

    lm = load_model(path, "cpu", "float32", progress=False)
    kernels = sorted({getattr(m.kernel, "name", "?") for m in lm.model.modules() if isinstance(m, QuantLinear)})
    engine = build_engine(lm, EngineArgs(kv_cache_memory="128MiB", max_num_seqs=1))
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best = 0.0
    with torch.inference_mode():
        for r in range(repeats):
            engine.add_request(f"r{r}", ids, params)
            stamps = []
            while engine.has_unfinished():
                for out in engine.step():
                    stamps += [time.perf_counter()] * len(out.new_token_ids)
            best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
            engine.block_manager.pool.reset_prefix_cache()
    name = f"{label} ({', '.join(kernels)} kernel)" if kernels else label
    return {"impl": name, "tok_s": best}


def transformers_generate(gguf: Path, tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t, self.first = [], True

        def put(self, value):
            if self.first:  # the prompt
                self.first = False
                return
            self.t.append(time.perf_counter())

        def end(self):
            pass

    best = 0.0
    with torch.inference_mode():
        for _ in range(repeats):
            s = Stamps()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=s,
                           pad_token_id=tok.eos_token_id)
            best = max(best, (len(s.t) - 1) / (s.t[-1] - s.t[0]))
    return {"impl": "transformers fp32 generate (eager)", "tok_s": best}


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
best = 0.0
for _ in range(repeats):
    t = []
    for tok in llm.generate(ids, temp=0.0, reset=True):
        t.append(time.perf_counter())
        if len(t) == tokens:
            break
    best = max(best, (len(t) - 1) / (t[-1] - t[0]))
print(json.dumps({"tok_s": best}))
"""


def llama_cpp(gguf: Path, tokens: int, repeats: int, threads: int) -> dict | None:
    """The same GGUF and the same prompt token ids, in a subprocess."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    from flotilla.models.tokenizer import load_tokenizer

    ids = load_tokenizer(gguf).apply_chat_template([{"role": "user", "content": PROMPT}])
    for no_extra, note in ((False, ""), (True, ", no repack: extra buffers crashed")):
        proc = subprocess.run([sys.executable, "-c", LLAMA_WORKER, str(gguf), str(tokens), str(repeats), str(threads),
                               "1" if no_extra else "0", json.dumps(ids)], capture_output=True, text=True)
        if proc.returncode == 0:
            return {"impl": f"llama.cpp Q4_1 (llama-cpp-python{note})", **json.loads(proc.stdout.strip().splitlines()[-1])}
    return {"impl": "llama.cpp Q4_1 (llama-cpp-python)", "tok_s": None, "error": proc.stderr.strip()[-200:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int4", default=None, help="an INT4 checkpoint (default: RTN-quantize the GGUF once, cached)")
    ap.add_argument("--skip", action="append", default=[], help="rows to skip: fp32, transformers, llama.cpp")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from flotilla.runtime.default_model import default_model_path
    from rtn_int4 import smollm2_int4_path

    gguf = default_model_path()
    rows = [ours(Path(args.int4) if args.int4 else smollm2_int4_path(gguf), args.tokens, args.repeats, "flotilla INT4")]
    if "fp32" not in args.skip:
        rows.append(ours(gguf, args.tokens, args.repeats, "flotilla fp32"))
    if "transformers" not in args.skip:
        rows.append(transformers_generate(gguf, args.tokens, args.repeats))
    if "llama.cpp" not in args.skip:
        row = llama_cpp(gguf, args.tokens, args.repeats, args.threads)
        if row is not None:
            rows.append(row)
    peer = next((r for r in rows if r["impl"].startswith("llama.cpp") and r.get("tok_s")), None)
    peer = peer or next((r for r in rows if r["impl"].startswith("transformers")), None)
    for r in rows:
        r.update(threads=args.threads, tokens=args.tokens)
        if peer and r.get("tok_s"):
            r["vs_" + peer["impl"].split()[0]] = r["tok_s"] / peer["tok_s"]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    ratio_col = "vs_" + peer["impl"].split()[0] if peer else None
    print(f"SmolLM2-135M single-stream decode, {args.tokens} tokens, {args.threads} threads (best of {args.repeats})")
    print(f"{'implementation':72s} {'tok/s':>8s} {'ratio':>7s}")
    for r in rows:
        tps = f"{r['tok_s']:.1f}" if r.get("tok_s") else "failed"
        ratio = f"{r[ratio_col]:.2f}x" if ratio_col and ratio_col in r else ""
        print(f"{r['impl']:72s} {tps:>8s} {ratio:>7s}")
        if r.get("error"):
            print(f"    {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
