"""Quantization quality and cost: perplexity, size, time and peak memory of `quantize`.

    python bench/quality.py [--json] [--asym] [--group-size G] [--models smollm2,llama-1b] [--threads N]

Rows, all measured in this run, each printed as soon as it is done:
  SmolLM2-135M-Instruct, the source (its GGUF dequantized to fp32): the peer of every other row
  INT8 RTN, INT4 RTN, INT4 GPTQ, INT4 GPTQ act-order   quantized from that GGUF by the `quantize` CLI
      with its defaults (mse grid, calibration text sampled from the model itself)
  INT4 RTN / GPTQ with --grid minmax                    what the grid search is worth
  INT4 GPTQ g32 asym act-order                          the most accurate 4-bit setting offered
  llama-1b (optional, minutes): a random-weight 1.24B Llama (Llama-3.2-1B shapes), RTN and GPTQ:
  quantize time and peak RSS; llama-8b the same at Llama-3.1-8B's shapes (with --device cuda)

Perplexity is `runtime eval-ppl`'s sliding window (ctx 512, stride 256) over two offline English
texts: "licenses", Debian's GPL-3 and Apache-2.0 (/usr/share/common-licenses), and "docs", the
first 60,000 characters of the Python documentation topics that ship with the interpreter
(pydoc_data.topics). Each quantize runs as its own process: time is its wall clock (calibration
text generation included), peak RSS its own (from wait4). Group size: 128 when it divides every
linear's input, else the largest of 64 and 32 that does (SmolLM2's hidden size 576 is not a
multiple of 128).

Targets checked at the end, on both texts: INT8 within +1% of the source; INT4 GPTQ strictly
better than INT4 RTN and within +10% of the source.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LICENSES = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
DOCS_CHARS = 60_000


@dataclass
class Row:
    model: str
    method: str
    ppl: dict[str, float]  # text -> perplexity ({} where not measured)
    delta_pct: dict[str, float]  # text -> % against the source
    size_mb: float
    fp16_ratio: float  # fp16 size / this size
    quantize_s: float | None
    peak_rss_mb: float | None
    note: str = ""


def run_measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """Run `quantize`; return (wall seconds, its peak RSS in MB as its summary reports it: VmHWM,
    which unlike wait4's ru_maxrss does not include this process's memory at fork)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{out}")
    peak = re.search(r"peak RSS ([\d,.]+) MB", out)
    if peak is None:
        raise SystemExit(f"no peak RSS in the summary of {' '.join(cmd)}\n{out}")
    return seconds, float(peak.group(1).replace(",", ""))


def checkpoint_mb(path: Path) -> float:
    files = list(path.glob("*.safetensors")) if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 1e6


def pick_group(cfg, wanted: int | None) -> int:
    inputs = (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
    if wanted is not None:
        return wanted
    return next(g for g in (128, 64, 32) if all(i % g == 0 for i in inputs))


def load_texts(args) -> dict[str, str]:
    texts = {"licenses": "\n\n".join(Path(t).read_text() for t in args.licenses)}
    if not args.no_docs:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        texts["docs"] = "\n\n".join(topics[k] for k in sorted(topics))[:DOCS_CHARS]
    return texts


def evaluate(path: Path, ids: dict[str, list[int]], ctx: int, stride: int) -> dict[str, float]:
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime.eval_ppl import perplexity

    model = load_stage(open_source(path))
    return {name: perplexity(model, toks, ctx, stride).ppl for name, toks in ids.items()}


def smollm2_rows(args, env, work: Path, emit) -> None:
    from flotilla.models.sources import open_source
    from flotilla.models.tokenizer import load_tokenizer
    from flotilla.quantize.pipeline import parameter_count
    from flotilla.runtime.default_model import default_model_path

    gguf = default_model_path()
    cfg = open_source(gguf).config
    fp16_mb = parameter_count(cfg) * 2 / 1e6
    group = pick_group(cfg, args.group_size)
    note = "" if group == 128 else f"g{group}: 128 does not divide hidden {cfg.hidden_size}"
    tokenizer = load_tokenizer(gguf)
    ids = {name: tokenizer.encode(text) for name, text in load_texts(args).items()}
    source = evaluate(gguf, ids, args.ctx, args.stride)
    counts = ", ".join(f"{name} {len(t)} tokens" for name, t in ids.items())
    emit(Row("SmolLM2-135M", "source (GGUF Q4_1 -> fp32)", source, {k: 0.0 for k in source}, checkpoint_mb(gguf),
             fp16_mb / checkpoint_mb(gguf), None, None, f"{counts}; ctx {args.ctx} stride {args.stride}"))
    grid = ["--asym"] if args.asym else ["--sym"]
    calib = [*(["--calib-samples", str(args.calib_samples)] if args.calib_samples else []),
             *(["--calib-seq-len", str(args.calib_seq_len)] if args.calib_seq_len else [])]
    g = ["--group-size", str(group)]
    configs = [
        (f"INT8 RTN g{group}", ["--bits", "8", "--method", "rtn", *g, *grid]),
        (f"INT4 RTN g{group}", ["--bits", "4", "--method", "rtn", *g, *grid]),
        (f"INT4 GPTQ g{group}", ["--bits", "4", "--method", "gptq", *g, *grid, *calib]),
        (f"INT4 GPTQ g{group} act-order", ["--bits", "4", "--method", "gptq", *g, *grid, "--act-order", *calib]),
        (f"INT4 RTN g{group} minmax", ["--bits", "4", "--method", "rtn", *g, *grid, "--grid", "minmax"]),
        (f"INT4 GPTQ g{group} minmax", ["--bits", "4", "--method", "gptq", *g, *grid, "--grid", "minmax", *calib]),
    ]
    if not args.asym and not args.short:
        configs.append(("INT4 GPTQ g32 act-order", ["--bits", "4", "--group-size", "32", "--asym", "--act-order",
                                                    *calib]))
    for label, flags in configs:
        out = work / label.replace(" ", "-")
        cmd = [sys.executable, "-m", "flotilla.quantize.cli", str(gguf), "-o", str(out), "--quiet", *flags]
        seconds, rss = run_measured(cmd, env)
        print(f"[{label}: quantized in {seconds:.0f} s, evaluating]", file=sys.stderr, flush=True)
        ppl = evaluate(out, ids, args.ctx, args.stride)
        size = checkpoint_mb(out)
        sym = " asym" if "--asym" in flags else " sym"
        method = label.replace(" act-order", sym + " act-order").replace(" minmax", sym + " minmax")
        method = method if method != label else label + sym
        emit(Row("SmolLM2-135M", method, ppl, {k: 100 * (v / source[k] - 1) for k, v in ppl.items()}, size,
                 fp16_mb / size, seconds, rss, note if f"g{group}" in label else ""))
        shutil.rmtree(out, ignore_errors=True)


SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads, tied embeddings) of the real model
    "llama-1b": (2048, 8192, 16, 32, 8, True),  # Llama-3.2-1B, 1.24B parameters
    "llama-8b": (4096, 14336, 32, 32, 8, False),  # Llama-3.1-8B, 8.03B parameters
}


def random_llama(directory: Path, shape: str) -> Path:
    """A random-weight Llama with the shapes of SHAPES[shape], fp16, one shard per layer."""
    import torch
    from safetensors.torch import save_file

    h, i, layers, heads, kv_heads, tied = SHAPES[shape]
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, intermediate_size=i,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=h // heads,
               vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=tied, bos_token_id=128000, eos_token_id=128001, torch_dtype="float16",
               hidden_act="silu")
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    kv = kv_heads * (h // heads)
    weight_map = {}

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).half()

    def write(name: str, tensors: dict):
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    ends = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h).half()}
    if not tied:
        ends["lm_head.weight"] = rnd(cfg["vocab_size"], h)
    write("embed.safetensors", ends)
    del ends
    for n in range(layers):
        p = f"model.layers.{n}."
        write(f"layer-{n:02d}.safetensors", {
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def random_llama_rows(args, env, work: Path, emit, shape: str) -> None:
    from flotilla.models.config import ModelConfig
    from flotilla.quantize.pipeline import parameter_count

    src = random_llama(work / f"{shape}-random", shape)
    params = parameter_count(ModelConfig.from_hf_dir(src))
    fp16_mb = params * 2 / 1e6
    calib = ["--calib-samples", str(args.calib_samples_1b), "--calib-seq-len", str(args.calib_seq_len_1b)]
    for label, flags in (("INT4 RTN g128", ["--method", "rtn"]), ("INT4 GPTQ g128", calib)):
        out = work / f"{shape}-{label.replace(' ', '-')}"
        seconds, rss = run_measured([sys.executable, "-m", "flotilla.quantize.cli", str(src), "-o", str(out),
                                     "--quiet", "--device", args.device, *flags], env)
        size = checkpoint_mb(out)
        note = f"{params / 1e9:.2f}B params, fp16 source {checkpoint_mb(src):.0f} MB, --device {args.device}"
        if "GPTQ" in label:
            note += f", calib {args.calib_samples_1b}x{args.calib_seq_len_1b} model-generated"
        emit(Row(f"random {shape}", label + " sym", {}, {}, size, fp16_mb / size, seconds, rss, note))
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)


class Table:
    """Prints the header once and each row as it arrives (or JSON lines)."""

    def __init__(self, texts: list[str], as_json: bool):
        self.texts, self.as_json, self.rows = texts, as_json, []
        if not as_json:
            cols = "".join(f" {'ppl ' + t:>13} {'Δ%':>7}" for t in texts)
            head = f"{'model':<18} {'method':<32}{cols} {'size MB':>8} {'×fp16':>6} {'quant s':>8} {'peak RSS MB':>11}  note"
            print(head)
            print("-" * len(head), flush=True)

    def __call__(self, r: Row) -> None:
        self.rows.append(r)
        if self.as_json:
            print(json.dumps(asdict(r)), flush=True)
            return
        cols = ""
        for t in self.texts:
            cols += f" {r.ppl[t]:13.3f} {r.delta_pct[t]:+7.2f}" if t in r.ppl else f" {'-':>13} {'-':>7}"
        qs = f"{r.quantize_s:8.1f}" if r.quantize_s is not None else f"{'-':>8}"
        rss = f"{r.peak_rss_mb:11.0f}" if r.peak_rss_mb is not None else f"{'-':>11}"
        print(f"{r.model:<18} {r.method:<32}{cols} {r.size_mb:8.1f} {r.fp16_ratio:6.2f} {qs} {rss}  {r.note}",
              flush=True)


def check_targets(rows: list[Row], texts: list[str]) -> list[str]:
    smol = [r for r in rows if r.model == "SmolLM2-135M"]

    def find(prefix: str, *exclude: str) -> Row:
        return next(r for r in smol if r.method.startswith(prefix) and not any(x in r.method for x in exclude))

    int8 = find("INT8")
    rtn = find("INT4 RTN", "minmax")
    gptq = find("INT4 GPTQ", "minmax", "act-order", "asym")
    act = next(r for r in smol if r.method.startswith("INT4 GPTQ") and "act-order" in r.method
               and r.method.split()[2] == gptq.method.split()[2])  # same group size
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = []
    for t in texts:
        lines += [
            f"[{t}] INT8 within +1% of the source: {int8.delta_pct[t]:+.2f}% -> {verdict(int8.delta_pct[t] <= 1.0)}",
            f"[{t}] INT4 GPTQ better than INT4 RTN: {gptq.ppl[t]:.3f} vs {rtn.ppl[t]:.3f} -> "
            f"{verdict(gptq.ppl[t] < rtn.ppl[t])}",
            f"[{t}] INT4 GPTQ within +10% of the source: {gptq.delta_pct[t]:+.2f}% -> "
            f"{verdict(gptq.delta_pct[t] <= 10.0)} (act-order: {act.delta_pct[t]:+.2f}% -> "
            f"{verdict(act.delta_pct[t] <= 10.0)})",
        ]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--licenses", nargs="+", default=list(LICENSES), help="the license texts to score "
                   "(default: GPL-3 and Apache-2.0)")
    p.add_argument("--no-docs", action="store_true", help="do not score the Python documentation text")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--group-size", type=int, default=None, help="default: 128 if it divides the model, else 64/32")
    p.add_argument("--asym", action="store_true", help="asymmetric grids for the quantized rows (default: sym, "
                                                       "the quantize default)")
    p.add_argument("--short", action="store_true", help="leave out the g32 asym act-order row")
    p.add_argument("--calib-samples", type=int, default=None, help="default: quantize's default")
    p.add_argument("--calib-seq-len", type=int, default=None, help="default: quantize's default")
    p.add_argument("--models", default="smollm2", help="comma-separated: smollm2 (default), llama-1b (a random "
                   "1.24B Llama: minutes, ~4 GB of disk), llama-8b (a random 8B Llama: for a GPU, ~25 GB of disk)")
    p.add_argument("--device", default="cpu", help="quantize --device for the random-Llama rows (default cpu)")
    p.add_argument("--calib-samples-1b", type=int, default=16)
    p.add_argument("--calib-seq-len-1b", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads here and in each quantize process")
    args = p.parse_args()
    for t in args.licenses:
        if not Path(t).is_file():
            raise SystemExit(f"text {t} not found (Debian's base-files package provides the defaults)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    models = args.models.split(",")
    unknown = set(models) - {"smollm2", *SHAPES}
    if unknown:
        raise SystemExit(f"unknown --models {', '.join(sorted(unknown))}; valid: smollm2, {', '.join(SHAPES)}")
    texts = ["licenses"] + ([] if args.no_docs else ["docs"])
    table = Table(texts if "smollm2" in models else [], args.json)
    with tempfile.TemporaryDirectory(prefix="flotilla-quality-") as tmp:
        if "smollm2" in models:
            smollm2_rows(args, env, Path(tmp), table)
        for shape in SHAPES:
            if shape in models:
                random_llama_rows(args, env, Path(tmp), table, shape)
    if "smollm2" in models and not args.json:
        print()
        print("\n".join(check_targets(table.rows, texts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
