"""End-to-end decode on one GPU: a llama-3-8b-shaped INT4 g128 model through flotilla's engine,
against transformers (fp16 eager, and bitsandbytes nf4) and the physical bound, in one run.

    python bench/gpu_decode.py                  # GPU checks, then the table
    python bench/gpu_decode.py --json           # one JSON object per row

Rows, per batch of concurrent streams (1, 16, 64; aggregate decode tok/s):
  flotilla int4 g128      the engine (scheduler, runner with CUDA graphs, the registry's kernels:
                          Triton on NVIDIA GPUs, sampler), decode steps overlapped (each launched
                          before the last one's tokens are read: the default on a GPU)
  flotilla int4 sync      the same with every step waiting for its tokens (EngineConfig.overlap=False)
  flotilla int4 no-pdl    the same without programmatic dependent launch (kernels/pdl.py; on sm_90+
                          the default launches the GEMV and the small Triton kernels as dependents)
  flotilla int4, int8 head  the same with the lm_head quantized too (8 bits, `lm_head: true` in the
                          config, as `quantize --lm-head-bits 8` writes it): a separate configuration
  flotilla int4, int4 head  the same at 4 bits (`--lm-head-bits 4`; only with `--also head4`)
  flotilla int4 CUDA      the same with the CUDA dequant-matmul (FLOTILLA_KERNEL=cuda)
  flotilla int4 eager     the same without CUDA graphs (what the graphs buy)
  flotilla int4 tuned     with each linear's tile config timed on the GPU first (`--tune`)
  flotilla fp16           unquantized linears (cuBLAS) through the same engine and graphs
  transformers fp16       LlamaForCausalLM from the same config, random weights on the GPU, its own
                          DynamicCache, a greedy loop of eager forwards (default sdpa attention)
  transformers nf4        the same model with every decoder linear swapped for bitsandbytes Linear4bit
  bound                   B / ((weight bytes + the batch's KV bytes) / HBM bandwidth), the bandwidth
                          measured here (device-to-device copy, read + write bytes)
All models have random weights of the real shape (no checkpoint, no download). Prompts are
`--prompt-len` random tokens; the clock covers decode steps only.

Before timing: paged attention on the GPU (Triton decode kernel + SDPA prefill) against the torch
reference on CPU in fp32, and the decode graphs' logits against the eager runner's on the
INT4 model. After: one profile of a batch-1 decode step (GPU time per kernel family against the
step's wall time), which says where the time goes, with and without overlap: the device's
timeline split into busy time, the short gaps between kernels inside a step (graph launch
latency) and the gaps over 20 µs (the device waiting for the host). `--profile-batches 16,64`
profiles those batches' steps too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]  # not bench/: its kernels.py would shadow the `kernels` package transformers probes for

from flotilla.kernels import pdl, registry  # noqa: E402
from flotilla.models.linear import QuantLinear  # noqa: E402
from flotilla.models.llama import NORM_FUSION_ENV, norm_fusion_enabled  # noqa: E402
from flotilla.runtime.bench import DecodeRun, bench_engine, measure, run_batches  # noqa: E402
from flotilla.runtime.random_model import build_random_model, shape_config, weight_bytes  # noqa: E402
from flotilla.runtime.sampling import SamplingParams  # noqa: E402
from bench.gpu_checks import (check_attention, check_engine_spec, check_fused, check_graphs, check_linears,  # noqa: E402
                              check_overlap, check_prefill, check_syncs, check_tile_silu)


# ------------------------------------------------------------------------------------- peers

def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    import triton.testing

    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3
    return 2 * 2 * 2**30 / t


def hf_model(name: str, device: str = "cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = shape_config(name, 16).to_hf_dict()
    d.pop("torch_dtype")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**d))
    finally:
        torch.set_default_dtype(default)
    return model.half().eval().requires_grad_(False)


def to_nf4(model) -> int:
    """Swap every decoder linear for a bitsandbytes nf4 Linear4bit (quantized on the GPU); returns
    how many were swapped."""
    import bitsandbytes as bnb

    swapped = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                          compute_dtype=torch.float16, quant_type="nf4", device="meta")
                    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
                    if lin.bias is not None:
                        q.bias = lin.bias
                    setattr(parent, name, q.to("cuda"))
                    swapped += 1
    torch.cuda.empty_cache()
    return swapped


@torch.inference_mode()
def hf_decode(model, batch: int, prompt_len: int, tokens: int) -> DecodeRun:
    """Greedy decode with transformers' own cache; the clock covers the decode forwards."""
    vocab = model.config.vocab_size
    device = model.lm_head.weight.device
    ids = torch.randint(0, vocab, (batch, prompt_len), device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    return DecodeRun(batch, prompt_len, batch * (tokens - 1), tokens - 1, time.perf_counter() - start, False)


# ------------------------------------------------------------------------------------- profile

@contextlib.contextmanager
def pdl_off():
    """Kernels launched (and graphs captured) inside launch without programmatic dependent launch."""
    before, pdl.ENABLED = pdl.ENABLED, False
    try:
        yield
    finally:
        pdl.ENABLED = before


def kernel_family(name: str) -> str:
    if "wqa16_kernel" in name or "flotilla::dequant_kernel" in name:
        return "int4 linears (CUDA)"
    if "w_dot" in name or "dequantize_kernel" in name:
        return "int4 linears (Triton)"
    if "flotilla::gemv::" in name:
        return "int4 linears (CUDA GEMV)"
    if "_decode_kernel" in name or "_combine_kernel" in name:
        return "paged attention (Triton)"
    if "gemm" in name.lower() or "gemv" in name.lower() or "cutlass" in name.lower() or "nvjet" in name.lower():
        return "lm_head (cuBLAS)"
    return "other (norms, rope, kv store, elementwise, copies)"


@torch.inference_mode()
def profile_decode(model, graphs: bool, prompt_len: int, steps: int = 16, top: int = 0,
                   overlap: bool | None = None, batch: int = 1) -> str:
    """GPU time per kernel family over `steps` decode steps of `batch` streams, against their wall time
    (and the `top` kernels by GPU time); the device timeline's busy time and idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    engine = bench_engine(model, batch, prompt_len + steps + 16, batch * prompt_len, graphs, overlap=overlap)
    measure(engine, batch, prompt_len, 8, seed=5)  # warm-up
    for i in range(batch):
        engine.add_request(f"p{i}", [1 + (i + j) % 1000 for j in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()  # the prefill (one step: the scheduler's token budget holds every prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # `steps` decode steps, each launched in the window
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = (time.perf_counter() - start) / steps
    fams: dict[str, float] = {}
    count: dict[str, int] = {}
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)  # µs over all steps
        if not t:
            continue
        fam = "copies and memsets" if e.key.startswith(("Memcpy", "Memset")) else kernel_family(e.key)
        fams[fam] = fams.get(fam, 0.0) + t / steps
        count[fam] = count.get(fam, 0) + e.count / steps
        kernels.append((t / steps, e.count / steps, e.key))
    total = sum(fams.values())
    mode = ("overlap" if engine.overlap else "sync") + ("" if pdl.ENABLED else ", no PDL")
    lines = [f"profile, batch-{batch} decode step {'with' if graphs else 'without'} graphs, {mode}: wall {wall * 1e3:.3f} ms, "
             f"GPU busy {total / 1e3:.3f} ms ({total / 1e3 / (wall * 1e3):.0%})"]
    lines.append("    " + device_timeline(prof, steps))
    for fam, t in sorted(fams.items(), key=lambda p: -p[1]):
        lines.append(f"    {fam:<52} {t / 1e3:7.3f} ms  {count[fam]:6.0f} kernels/step")
    if top:
        lines.append(f"  top {top} kernels (µs/step, calls/step, mean µs):")
        for t, n, name in sorted(kernels, reverse=True)[:top]:
            lines.append(f"    {t:8.1f} {n:5.0f} {t / n:7.2f}  {name[:110]}")
    return "\n".join(lines)


def device_timeline(prof, steps: int, host_gap_us: float = 20.0) -> str:
    """The device's activity over the profiled steps, per step: span (first start to last end),
    busy (union of kernels and copies), gaps shorter than `host_gap_us` (between kernels of a
    step: launch latency inside a graph) and longer (the device waiting for the host)."""
    from torch.autograd import DeviceType

    spans = sorted((e.start_ns() / 1e3, e.end_ns() / 1e3) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0)
    if not spans:
        return "device timeline: no device events recorded"
    busy = short = long = 0.0
    n_long, (cur_s, cur_e) = 0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:  # a gap
            busy += cur_e - cur_s
            gap = s - cur_e
            if gap > host_gap_us:
                long += gap
                n_long += 1
            else:
                short += gap
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    return (f"device timeline per step: span {span / steps:.1f} µs = busy {busy / steps:.1f} + in-step gaps "
            f"{short / steps:.1f} + waiting for the host {long / steps:.1f} ({n_long} gaps > {host_gap_us:.0f} µs "
            f"in {steps} steps)")


# ------------------------------------------------------------------------------------- main

def tune_linears(model, batches: list[int]) -> float:
    """Time each linear shape's candidate tile configs once and give the winners to every linear
    of that shape. Returns seconds spent."""
    start = time.perf_counter()
    winners: dict[tuple, dict] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and hasattr(mod.kernel, "tune"):
            key = (mod.in_features, mod.out_features, mod.bits)
            if key not in winners:
                winners[key] = {m: cfg for m, (_, cfg) in mod.kernel.tune(batches).items()}
            else:
                for m, cfg in winners[key].items():  # one candidate: sets it without a search
                    mod.kernel.tune([m], candidates=lambda _m, c=cfg: [c])
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream, flotilla rows")
    ap.add_argument("--hf-tokens", type=int, default=32, help="tokens per stream, transformers rows")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tune", action="store_true", help="also the int4 rows after tuning tile configs on the GPU")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: eager, profile, hf (both "
                                               "transformers rows), nf4, fp16, cuda, sync (the int4 rows "
                                               "without overlap), nopdl (the int4 rows and profile without "
                                               "programmatic dependent launch), nofuse (the int4 rows with the norms the other way: in the GEMVs or as kernels of their own), head8 (the int4 rows with an int8 lm_head), slow-checks (attention, fused ops, "
                                               "engine spec), spec-check (the engine spec check alone)")
    ap.add_argument("--also", default="", help="comma-separated parts left out unless named: head4 (the int4 "
                                               "rows with a 4-bit lm_head, `quantize --lm-head-bits 4`)")
    ap.add_argument("--profile-batches", default="", help="comma-separated batches whose decode step is also "
                                                          "profiled (graphs, overlap), e.g. 16,64")
    ap.add_argument("--checks-only", action="store_true", help="run the checks on the model, then stop (no rows; "
                                                               "exit status 1 if one failed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_decode.py needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(args.skip.split(","))
    wanted = set(args.also.split(","))
    profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    cfg = shape_config(args.shape, 4)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    rows: dict[str, dict[int, DecodeRun]] = {}

    def section(label, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception:  # noqa: BLE001 - one failing peer is reported; the others still run
            print(f"[{label}] FAILED:\n{traceback.format_exc()}", flush=True)
            return None
        print(f"[{label}] {time.perf_counter() - t0:.1f}s", flush=True)
        return out

    def hf_rows(label, hf):
        rows[label] = {}
        for b in batches:
            hf_decode(hf, b, args.prompt_len, 3)  # warm-up
            r = section(f"{label} b{b}", lambda: hf_decode(hf, b, args.prompt_len, args.hf_tokens))
            if r is not None:
                rows[label][b] = r
                print(f"  {label:<22} batch {b:3d}: {r.tok_s:9.1f} tok/s", flush=True)

    def ours(label, model, graphs=True, bs=batches, tokens=args.tokens, overlap=None):
        rows[label] = {}
        for r in run_batches(model, bs, args.prompt_len, tokens, graphs, overlap=overlap):
            rows[label][r.batch] = r
            print(f"  {label:<22} batch {r.batch:3d}: {r.tok_s:9.1f} tok/s ({r.tok_s_per_stream:7.1f} per stream, "
                  f"{r.ms_per_step:6.2f} ms/step)", flush=True)

    slow = "slow-checks" not in skip
    failed: list[str] = []

    def check(label, fn):
        """One check's line printed; a failure (its line ends in FAIL, or it raised) remembered."""
        line = section(label, fn)
        print(line, flush=True)
        if line is None or line.endswith("FAIL"):
            failed.append(label)
        return line

    if slow:
        check("attention check", check_attention)
        if args.shape == "llama-3-70b":
            check("attention check (70b heads)", lambda: check_attention(hq=64))
    bw = section("HBM bandwidth", copy_bandwidth)
    model = section("build int4", lambda: build_random_model(args.shape, 4, "cuda", torch.float16))
    wbytes = weight_bytes(model)
    print(f"int4 model: {wbytes / 1e9:.2f} GB read per decode step; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if slow:
        check("fused ops check", lambda: check_fused(model))
    check("prefill check", lambda: check_prefill(model))
    check("tile silu check", lambda: check_tile_silu(model))
    if "prefill check" in failed:  # which linear call went wrong first
        check("linears check", lambda: check_linears(model))
    check("graph check", lambda: check_graphs(model))
    for overlap in (False, True):
        check("sync check", lambda: check_syncs(model, overlap=overlap))
    check("overlap check", lambda: check_overlap(model))
    if slow and "spec-check" not in skip:
        check("engine spec check", check_engine_spec)
    if failed:
        print(f"FAILED checks: {', '.join(failed)}", flush=True)
    if args.checks_only:
        return 1 if failed else 0
    section("flotilla int4", lambda: ours("flotilla int4 g128", model))
    if "sync" not in skip:
        section("flotilla int4 sync", lambda: ours("flotilla int4 sync", model, overlap=False))
    if "nopdl" not in skip:
        def nopdl_rows():
            with pdl_off():
                ours("flotilla int4 no-pdl", model)
        section("flotilla int4 no-pdl", nopdl_rows)
    if "nofuse" not in skip:  # the int4 rows the other way: norms in the GEMVs or as kernels of their own
        fused_now = norm_fusion_enabled()
        other = "flotilla int4 norm kernels" if fused_now else "flotilla int4 norms in GEMVs"

        def other_rows():
            before = os.environ.get(NORM_FUSION_ENV)
            os.environ[NORM_FUSION_ENV] = "0" if fused_now else "1"  # read when the runner freezes the model
            try:
                ours(other, model)
            finally:
                os.environ.pop(NORM_FUSION_ENV) if before is None else os.environ.update({NORM_FUSION_ENV: before})
        section(other, other_rows)
    if "cuda" not in skip:
        def cuda_rows():
            os.environ[registry.ENV_KERNEL] = "cuda"
            try:
                forced = build_random_model(args.shape, 4, "cuda", torch.float16)
            finally:
                del os.environ[registry.ENV_KERNEL]
            ours("flotilla int4 CUDA", forced)
        section("flotilla int4 CUDA", cuda_rows)
        torch.cuda.empty_cache()
    for head_bits in (8, 4):
        part = f"head{head_bits}"
        if part in skip or (head_bits == 4 and part not in wanted):  # the int4 head only when asked for
            continue

        def head_rows(head_bits=head_bits):
            headed = build_random_model(args.shape, 4, "cuda", torch.float16, head_bits=head_bits)
            ours(f"flotilla int4, int{head_bits} head", headed)
            if "profile" not in skip:
                print(section("profile", lambda: profile_decode(headed, True, args.prompt_len, top=4)), flush=True)
        section(f"flotilla int4, int{head_bits} head", head_rows)
        torch.cuda.empty_cache()
    if "eager" not in skip:
        section("flotilla int4 eager", lambda: ours("flotilla int4 eager", model, graphs=False, bs=[1], tokens=32))
    if "profile" not in skip:
        for graphs, overlap in ((True, None), (True, False), (False, None)):
            if graphs or "eager" not in skip:
                print(section("profile", lambda: profile_decode(model, graphs, args.prompt_len, top=16 if graphs and overlap is None else 0,
                                                                overlap=overlap)), flush=True)
        if "nopdl" not in skip:
            with pdl_off():
                print(section("profile", lambda: profile_decode(model, True, args.prompt_len, top=16)), flush=True)
    for b in profile_batches:
        print(section(f"profile b{b}", lambda: profile_decode(model, True, args.prompt_len, top=12, batch=b)),
              flush=True)
    if "hf" not in skip:
        hf = section("build transformers fp16", lambda: hf_model(args.shape))
        hf_rows("transformers fp16", hf)
        if "nf4" not in skip and section("convert to nf4", lambda: to_nf4(hf)) is not None:
            hf_rows("transformers nf4", hf)
        del hf
        torch.cuda.empty_cache()
    if "fp16" not in skip:
        fp16 = section("build fp16", lambda: build_random_model(args.shape, 16, "cuda", torch.float16))
        section("flotilla fp16", lambda: ours("flotilla fp16", fp16, tokens=64))
        del fp16
        torch.cuda.empty_cache()
    report(rows, batches, cfg, wbytes, bw, args)
    if args.tune:
        section("tune", lambda: tune_linears(model, batches))
        section("flotilla int4 tuned", lambda: ours("flotilla int4 tuned", model))
        report(rows, batches, cfg, wbytes, bw, args)
    return 0


def report(rows, batches, cfg, wbytes: int, bw: float, args) -> None:
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # fp16 K and V
    mean_ctx = args.prompt_len + args.tokens / 2
    bound = {b: b / ((wbytes + b * mean_ctx * kv_per_token) / bw) for b in batches}
    labels = list(rows)
    if args.json:
        for label in labels:
            for b, r in rows[label].items():
                print(json.dumps({"engine": label, "shape": args.shape, **r.row(), "bound_tok_s": bound[b],
                                  "of_bound": r.tok_s / bound[b]}))
        return
    head = ["batch"] + [f"{label} tok/s" for label in labels] + ["bound tok/s", "int4 / bound"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    main_rows = rows.get("flotilla int4 g128", {})
    for b in batches:
        cells = [str(b)] + [f"{rows[lbl][b].tok_s:.1f}" if b in rows[lbl] else "n/a" for lbl in labels]
        ratio = f"{main_rows[b].tok_s / bound[b]:.0%}" if b in main_rows else "n/a"
        print("| " + " | ".join(cells + [f"{bound[b]:.0f}", ratio]) + " |")
    for peer in ("transformers fp16", "transformers nf4"):
        if peer in rows and 1 in rows[peer] and 1 in main_rows:
            print(f"batch 1: flotilla int4 is {main_rows[1].tok_s / rows[peer][1].tok_s:.1f}x {peer}")


if __name__ == "__main__":
    raise SystemExit(main())
