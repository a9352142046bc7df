"""Quantization quality and cost: perplexity, size, time and peak memory of `quantize`.

    python bench/quality.py [--json] [--asym] [--group-size G] [--models smollm2,llama-1b] [--threads N]

Rows, all measured in this run:
  SmolLM2-135M-Instruct, the source (its GGUF dequantized to fp32): the peer of every other row
  INT8 RTN, INT4 RTN, INT4 GPTQ, INT4 GPTQ act-order   quantized from that GGUF by the `quantize` CLI
  llama-1b (optional, minutes): a random-weight 1.24B Llama (Llama-3.2-1B shapes), RTN and GPTQ:
  quantize time and peak RSS

Perplexity is `runtime eval-ppl`'s sliding window over Debian's GPL-3 and Apache-2.0 license texts
(/usr/share/common-licenses). Each quantize runs as its own process: time is its wall clock, peak
RSS its own (from wait4). Group size: 128 when it divides every linear's input, else the largest
of 64 and 32 that does (SmolLM2's hidden size 576 is not a multiple of 128).

Targets checked at the end: INT8 within +1% of the source; INT4 GPTQ strictly better than INT4 RTN
and within +10% of the source.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


@dataclass
class Row:
    model: str
    method: str
    ppl: float | None
    delta_pct: float | None
    size_mb: float
    fp16_ratio: float  # fp16 size / this size
    quantize_s: float | None
    peak_rss_mb: float | None
    note: str = ""


def run_measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """Run a command; return (wall seconds, peak RSS MB of that process)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{out}\n{err}")
    return seconds, usage.ru_maxrss / 1024


def checkpoint_mb(path: Path) -> float:
    files = list(path.glob("*.safetensors")) if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 1e6


def pick_group(cfg, wanted: int | None) -> int:
    inputs = (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
    if wanted is not None:
        return wanted
    return next(g for g in (128, 64, 32) if all(i % g == 0 for i in inputs))


def evaluate(path: Path, ids: list[int], ctx: int, stride: int) -> float:
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime.eval_ppl import perplexity

    return perplexity(load_stage(open_source(path)), ids, ctx, stride).ppl


def smollm2_rows(args, env, work: Path) -> list[Row]:
    from flotilla.models.sources import open_source
    from flotilla.models.tokenizer import load_tokenizer
    from flotilla.quantize.pipeline import parameter_count
    from flotilla.runtime.default_model import default_model_path

    gguf = default_model_path()
    cfg = open_source(gguf).config
    fp16_mb = parameter_count(cfg) * 2 / 1e6
    group = pick_group(cfg, args.group_size)
    note = "" if group == 128 else f"g128 does not divide hidden {cfg.hidden_size}"
    text = "\n\n".join(Path(t).read_text() for t in args.text)
    ids = load_tokenizer(gguf).encode(text)
    source_ppl = evaluate(gguf, ids, args.ctx, args.stride)
    rows = [Row("SmolLM2-135M", "source (GGUF Q4_1 -> fp32)", source_ppl, 0.0, checkpoint_mb(gguf),
                fp16_mb / checkpoint_mb(gguf), None, None, f"{len(ids)} tokens, ctx {args.ctx} stride {args.stride}")]
    grid = ["--asym"] if args.asym else ["--sym"]
    calib = [*(["--calib-samples", str(args.calib_samples)] if args.calib_samples else []),
             *(["--calib-seq-len", str(args.calib_seq_len)] if args.calib_seq_len else [])]
    configs = [
        (f"INT8 RTN g{group}", ["--bits", "8", "--method", "rtn", "--group-size", str(group), *grid]),
        (f"INT4 RTN g{group}", ["--bits", "4", "--method", "rtn", "--group-size", str(group), *grid]),
        (f"INT4 GPTQ g{group}", ["--bits", "4", "--method", "gptq", "--group-size", str(group), *grid, *calib]),
        (f"INT4 GPTQ g{group} act-order", ["--bits", "4", "--method", "gptq", "--group-size", str(group), *grid,
                                           "--act-order", *calib]),
    ]
    for label, flags in configs:
        out = work / label.replace(" ", "-")
        cmd = [sys.executable, "-m", "flotilla.quantize.cli", str(gguf), "-o", str(out), "--quiet", *flags]
        seconds, rss = run_measured(cmd, env)
        print(f"[{label}: quantized in {seconds:.0f} s, evaluating]", file=sys.stderr, flush=True)
        p = evaluate(out, ids, args.ctx, args.stride)
        size = checkpoint_mb(out)
        method = label + (" asym" if args.asym else " sym")
        rows.append(Row("SmolLM2-135M", method, p, 100 * (p / source_ppl - 1), size, fp16_mb / size, seconds, rss,
                        note))
    return rows


def random_llama_1b(directory: Path) -> Path:
    """A random-weight Llama with Llama-3.2-1B's shapes (1.24B parameters), fp16, one shard per layer."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
               bos_token_id=128000, eos_token_id=128001, torch_dtype="float16", hidden_act="silu")
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    h, i, kv = 2048, 8192, 8 * 64
    weight_map = {}

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).half()

    def write(name: str, tensors: dict):
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    write("embed.safetensors", {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h),
                                "model.norm.weight": torch.ones(h, dtype=torch.float16)})
    for n in range(cfg["num_hidden_layers"]):
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


def llama_1b_rows(args, env, work: Path) -> list[Row]:
    from flotilla.models.config import ModelConfig
    from flotilla.quantize.pipeline import parameter_count

    src = random_llama_1b(work / "llama-1b-random")
    params = parameter_count(ModelConfig.from_hf_dir(src))
    fp16_mb = params * 2 / 1e6
    rows = []
    for label, flags in (("INT4 RTN g128", ["--method", "rtn"]),
                         ("INT4 GPTQ g128", ["--calib-samples", str(args.calib_samples_1b),
                                             "--calib-seq-len", str(args.calib_seq_len_1b)])):
        out = work / ("llama-1b-" + label.replace(" ", "-"))
        seconds, rss = run_measured([sys.executable, "-m", "flotilla.quantize.cli", str(src), "-o", str(out),
                                     "--quiet", *flags], env)
        size = checkpoint_mb(out)
        note = f"{params / 1e9:.2f}B params, fp16 source {checkpoint_mb(src):.0f} MB"
        if "GPTQ" in label:
            note += f", calib {args.calib_samples_1b}x{args.calib_seq_len_1b} model-generated"
        rows.append(Row("random Llama 1.2B", label + " sym", None, None, size, fp16_mb / size, seconds, rss, note))
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'model':<18} {'method':<34} {'ppl':>8} {'Δ%':>7} {'size MB':>8} {'×fp16':>6} {'quant s':>8} " \
           f"{'peak RSS MB':>11}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        ppl = f"{r.ppl:8.3f}" if r.ppl is not None else f"{'-':>8}"
        delta = f"{r.delta_pct:+7.2f}" if r.delta_pct is not None else f"{'-':>7}"
        qs = f"{r.quantize_s:8.1f}" if r.quantize_s is not None else f"{'-':>8}"
        rss = f"{r.peak_rss_mb:11.0f}" if r.peak_rss_mb is not None else f"{'-':>11}"
        print(f"{r.model:<18} {r.method:<34} {ppl} {delta} {r.size_mb:8.1f} {r.fp16_ratio:6.2f} {qs} {rss}  {r.note}")


def check_targets(rows: list[Row]) -> list[str]:
    smol = {r.method.split(" sym")[0].split(" asym")[0]: r for r in rows if r.model == "SmolLM2-135M"}
    int8 = next(r for k, r in smol.items() if k.startswith("INT8"))
    rtn = next(r for k, r in smol.items() if k.startswith("INT4 RTN"))
    gptq = next(r for k, r in smol.items() if k.startswith("INT4 GPTQ") and "act-order" not in k)
    act = next(r for k, r in smol.items() if "act-order" in k)
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    return [
        f"INT8 within +1% of the source: {int8.delta_pct:+.2f}% -> {verdict(int8.delta_pct <= 1.0)}",
        f"INT4 GPTQ better than INT4 RTN: {gptq.ppl:.3f} vs {rtn.ppl:.3f} -> {verdict(gptq.ppl < rtn.ppl)}",
        f"INT4 GPTQ within +10% of the source: {gptq.delta_pct:+.2f}% -> {verdict(gptq.delta_pct <= 10.0)} "
        f"(act-order: {act.delta_pct:+.2f}% -> {verdict(act.delta_pct <= 10.0)})",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--text", nargs="+", default=list(TEXTS), help="texts to score (default: GPL-3 and Apache-2.0)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--group-size", type=int, default=None, help="default: 128 if it divides the model, else 64/32")
    p.add_argument("--asym", action="store_true", help="asymmetric grids for the quantized rows (default: sym, "
                                                       "the quantize default)")
    p.add_argument("--calib-samples", type=int, default=None, help="default: quantize's default")
    p.add_argument("--calib-seq-len", type=int, default=None, help="default: quantize's default")
    p.add_argument("--models", default="smollm2", help="comma-separated: smollm2 (default), llama-1b (a random "
                                                    "1.24B Llama: minutes, ~4 GB of disk)")
    p.add_argument("--calib-samples-1b", type=int, default=16)
    p.add_argument("--calib-seq-len-1b", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads here and in each quantize process")
    args = p.parse_args()
    for t in args.text:
        if not Path(t).is_file():
            raise SystemExit(f"text {t} not found (Debian's common-licenses package provides the defaults)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    models = args.models.split(",")
    unknown = set(models) - {"smollm2", "llama-1b"}
    if unknown:
        raise SystemExit(f"unknown --models {', '.join(sorted(unknown))}; valid: smollm2, llama-1b")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="flotilla-quality-") as tmp:
        if "smollm2" in models:
            rows += smollm2_rows(args, env, Path(tmp))
        if "llama-1b" in models:
            rows += llama_1b_rows(args, env, Path(tmp))
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print_table(rows)
        if "smollm2" in models:
            print()
            print("\n".join(check_targets(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
