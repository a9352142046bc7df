"""GGUF forms on the GPU: flotilla's Triton kernels for GGUF blocks (kernels/triton_ggml.py) next to
fp16 cuBLAS and the GPTQ-layout W4A16 kernel, in the same run (`python bench/kernels.py --gguf`).

Per weight shape (in x out, bench/kernels.py's four) and batch (default 1 and 16): µs per call
(median, L2 cleared; with --graph, CUDA-graph replays) of fp16 F.linear, the GPTQ W4 kernel
(group 128) and each GGUF form, with the form's bytes a call reads and the bandwidth that makes.
Before timing, every form is checked against its exact dequantized weight (fp32 matmul), in fp16
and in bf16, and the embedded default GGUF's logits on CUDA against the CPU's: a FAIL line names
what is off.

With --gemv-sweep (after the table; --only-sweeps: instead of it): per form, shape and batch up to 8
(--gemv-rows; 9-16 rows: the wide tensor-core plan where the layout has it), the CUDA GEMV's plans
(kernels/cuda/gemv.py: the tensor-core plan on the group-32 forms, float offsets included since round
21, the CUDA-core plans; 1, 2, 4 and 8 warps) each checked against the dequantized weight, then timed
next to the Triton path the registry takes for GGUF forms today, and with --gemv-chain the best of
them back to back as a decode step runs them (kernels_gemv.chain_case):
the evidence for the GEMV's crossover on these layouts (gemv.crossover).

With --tune (after the table): per form, shape and batch, the default config's time next to the
fastest of the candidate configs (triton_linear.candidate_configs, with the group scale on either
side where the form allows), the evidence for the defaults.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from flotilla.kernels.ggml import GGMLWeight
from flotilla.kernels.triton_ggml import TRITON_FORMS, TritonGGMLKernel
from flotilla.runtime.random_model import random_ggml_weight

GGUF_FORMS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")
TUNE_FORMS = ("Q4_0", "Q4_K", "Q8_0", "Q6_K")  # one of each kernel specialisation (Q4_1 runs as Q4_K)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def random_ggml(qtype: str, k: int, n: int, device="cuda") -> GGMLWeight:
    """Random blocks of a form for a [k -> n] weight, built on the device (runtime.random_model's: codes
    centred on zero, fp16-exact scales where the form stores fp16)."""
    return random_ggml_weight(qtype, n, k, torch.Generator(device=device).manual_seed(0))


def check_forms(k: int = 4096, n: int = 4096) -> list[str]:
    """Every Triton form against its dequantized weight, fp16 and bf16, decode and wider batches."""
    lines = []
    for qtype in TRITON_FORMS:
        w = random_ggml(qtype, k, n)
        dense = w.dequantize()
        for dtype, tol in TOLERANCE.items():
            kernel = TritonGGMLKernel([w], torch.device("cuda"), dtype)
            for m in (1, 16, 40, 64, 100):
                x = torch.randn(m, k, device="cuda").to(dtype)
                ref = x.float() @ dense.t()
                err = ((kernel(x).float() - ref).norm() / ref.norm()).item()
                if not err < tol:
                    lines.append(f"FAIL {qtype} {str(dtype)[6:]} m={m}: relative error {err:.2e} (tolerance {tol})")
    return lines


def check_model() -> list[str]:
    """The embedded default GGUF end to end on the GPU (fp16, Triton forms) against the CPU (fp32,
    compiled kernels): logits of one prompt within 2% and the same argmax at almost every position."""
    from flotilla.errors import FlotillaError
    from flotilla.models.attention import DenseCausalAttention
    from flotilla.models.sources import open_source
    from flotilla.models.weights import load_stage
    from flotilla.runtime.default_model import default_model_path

    try:
        path = default_model_path(fetch=False)
    except FlotillaError as e:  # a GPU box with no way out: carry the file (FLOTILLA_CACHE_DIR) to check it
        print(f"  default GGUF end to end: skipped ({e})", flush=True)
        return []
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device, dtype in (("cuda", torch.float16), ("cpu", torch.float32)):
        model = load_stage(open_source(path), device=device, dtype=dtype)
        forms = model.model.layers["0"].mlp.gate_up_proj.kernel.name
        with torch.inference_mode():
            h = model(ids.to(device), torch.arange(64, device=device), DenseCausalAttention(1, 64))
            logits[device] = model.compute_logits(h).float().cpu()
        if device == "cuda" and not forms.startswith("triton"):
            return [f"FAIL the model's linears run {forms!r} on CUDA, not the Triton forms"]
    err = ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item()
    agree = (logits["cuda"].argmax(-1) == logits["cpu"].argmax(-1)).float().mean().item()
    return [] if err < 0.02 and agree > 0.9 else [f"FAIL default GGUF on CUDA: relative error {err:.3g}, argmax agree {agree:.0%}"]


def run_gguf(args, time_us, gptq_kernel) -> int:
    """The --gguf table. `time_us` and `gptq_kernel(k, n)` come from bench/kernels.py."""
    torch.manual_seed(0)
    fails = [] if args.skip_check else check_forms() + check_model()
    print(f"GGUF forms vs their dequantized weights, and the default GGUF on CUDA vs CPU: "
          f"{'OK' if not fails else f'{len(fails)} FAILED'}", flush=True)
    for line in fails:
        print("  " + line, flush=True)
    rows = []
    for k, n in [] if args.only_sweeps else args.shapes:
        rows += shape_rows(k, n, args, time_us, gptq_kernel)
        torch.cuda.empty_cache()
    if rows and not args.json:
        print(_table(rows), flush=True)
    if args.gemv_sweep:
        for k, n in args.shapes:
            fails += gemv_sweep_shape(k, n, args, time_us)
            torch.cuda.empty_cache()
    if args.tune:
        for k, n in args.shapes:
            tune_shape(k, n, args, time_us)
            torch.cuda.empty_cache()
    return 1 if fails else 0


GEMV_FORMS = ("Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0")  # one of each layout kind (Q4_1 runs as Q4_K, Q5_1 as
# Q5_K: 8-bit codes with offsets)


def gemv_sweep_shape(k: int, n: int, args, time_us) -> list[str]:
    """--gemv-sweep: per GGUF form and batch, every GEMV plan (checked, then timed) against the Triton path."""
    from bench.kernels_gemv import chain_case, label, triton_config
    from flotilla.kernels.cuda.gemv import MMA_COLS, ROW_TILES, WIDE_ROWS

    fails = []
    for q in args.gemv_forms.split(",") if args.gemv_forms else GEMV_FORMS:
        w = random_ggml(q, k, n)
        dense = w.dequantize()
        kern = TritonGGMLKernel([w], torch.device("cuda"), torch.float16).runs[0][2]
        if kern.gemv is None:
            print(f"gguf gemv {q} {k}x{n}: no GEMV for this layout (see the log)", flush=True)
            continue
        geo = kern.gemv.geo
        for m in [r for r in args.gemv_rows if r <= kern.gemv.most_rows]:  # 9-16: the wide plan
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = x.float() @ dense.t()
            timed = []
            for shape in kern.gemv.plans():
                if (shape.rows == WIDE_ROWS) != (m > ROW_TILES[-1]) or (shape.rows <= ROW_TILES[-1] and (
                        (shape.cols != MMA_COLS and shape.rows != next(r for r in ROW_TILES if r >= m))
                        or (shape.cols == MMA_COLS and shape.stages not in (0, 2, 4)))):
                    continue
                for warps in (1, 2, 4, 8):
                    plan = dataclasses.replace(shape, warps=warps)
                    err = ((kern.gemv(x, plan=plan).float() - ref).norm() / ref.norm()).item()
                    if not err < TOLERANCE[torch.float16]:
                        fails.append(f"FAIL gguf gemv {q} {k}x{n} m={m} {plan}: relative error {err:.2e}")
                        print("  " + fails[-1], flush=True)
                        continue
                    timed.append((time_us(lambda: kern.gemv(x, plan=plan), warmup=5, rep=20), plan))
            timed.sort(key=lambda p: p[0])
            t_triton = time_us(lambda: kern(x, config=triton_config(kern, m)))
            built = kern.gemv.plan_for(m)
            t_built = time_us(lambda: kern.gemv(x, plan=built))
            best = ", ".join(f"{t:.1f} {label(p)}" for t, p in timed[:4])
            print(f"gguf gemv {q} {k}x{n} m={m} (mode {geo.mode}, {1 << geo.log2r} words a block, mma {geo.mma}): "
                  f"triton {t_triton:.1f}us, gemv built-in {label(built)} {t_built:.1f}us "
                  f"({kern.layout.nbytes() / (t_built * 1e-6) / 1e12:.2f} TB/s); best {best}", flush=True)
            if args.gemv_chain and timed:
                chain_case(kern, x, [p for _, p in timed[:3]] + [built], m, args.json)
            if args.json:
                print(json.dumps({"gguf_gemv": f"{k}x{n}", "form": q, "m": m, "triton_us": t_triton,
                                  "built_in_us": t_built, "built_in": built.__dict__,
                                  "plans": [[t, p.__dict__] for t, p in timed]}), flush=True)
        del dense
    return fails


def tune_shape(k: int, n: int, args, time_us) -> None:
    """--tune: print the default config and time of TUNE_FORMS next to their three fastest candidates."""
    from flotilla.kernels.triton_linear import candidate_configs, weight_side

    for q in TUNE_FORMS:
        kern = TritonGGMLKernel([random_ggml(q, k, n)], torch.device("cuda"), torch.float16).runs[0][2]
        for m in args.batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            default = kern.config_for(m)
            cands = candidate_configs(m, kern.layout, kern.num_sms)
            cands += [dataclasses.replace(c, scale_w=not c.scale_w) for c in cands if c.kind == "dot"]
            cands += [dataclasses.replace(c, num_stages=5) for c in cands if c.kind == "dot" and c.num_stages == 4]
            wide = [c for c in cands if c.kind == "dot" and c.block_n == 256 and c.num_warps == 4]
            cands += [dataclasses.replace(c, num_warps=8) for c in wide]
            cands += [dataclasses.replace(c, block_n=512, num_warps=8, split_k=s) for c in wide[:1] for s in (1, 2, 4)]
            timed = []
            for cfg in dict.fromkeys(weight_side(c, kern.layout) for c in cands):
                try:
                    timed.append((time_us(lambda: kern(x, config=cfg), warmup=5, rep=20), cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
            timed.sort(key=lambda p: p[0])
            best = "; ".join(f"{t:.1f} µs {c}" for t, c in timed[:3])
            print(f"tune {q} {k}x{n} m={m}: default {time_us(lambda: kern(x)):.1f} µs {default}; best {best}", flush=True)


def shape_rows(k: int, n: int, args, time_us, gptq_kernel) -> list[dict]:
    """The rows of one weight shape, per batch: fp16, GPTQ W4 and every GGUF form."""
    w16 = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    gptq = gptq_kernel(k, n)
    forms = {q: TritonGGMLKernel([random_ggml(q, k, n)], torch.device("cuda"), torch.float16) for q in GGUF_FORMS}
    rows = []
    for m in args.batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        row = {"shape": f"{k}x{n}", "batch": m, "fp16_us": time_us(lambda: torch.nn.functional.linear(x, w16)),
               "gptq_w4_us": time_us(lambda: gptq(x))}
        for q, kern in forms.items():
            t = time_us(lambda: kern(x))
            row[f"{q}_us"] = t
            row[f"{q}_tbps"] = kern.nbytes / (t * 1e-6) / 1e12
            row[f"{q}_x_fp16"] = row["fp16_us"] / t
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    head = ["shape", "batch", "fp16 µs", "GPTQ W4 µs"] + [f"{q} µs (×fp16, TB/s)" for q in GGUF_FORMS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], str(r["batch"]), f"{r['fp16_us']:.1f}", f"{r['gptq_w4_us']:.1f}"]
        cells += [f"{r[f'{q}_us']:.1f} ({r[f'{q}_x_fp16']:.2f}, {r[f'{q}_tbps']:.2f})" for q in GGUF_FORMS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
