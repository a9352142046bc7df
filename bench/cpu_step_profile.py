"""Where a single-stream decode step's time goes (SmolLM2-135M INT4 on CPU).

    python bench/cpu_step_profile.py                # table
    python bench/cpu_step_profile.py --context 1000 --json

Decodes one stream to --context tokens, then profiles --steps decode steps with torch.profiler
and sorts the ops' self CPU time into groups: the linears (the dequant-matmul kernels and the
fp32 lm_head), attention (SDPA, KV store/gather), norms, rotary, other tensor ops; what is left
of the wall time is Python (scheduler, step input, sampler bookkeeping, the layer loop).
Without the profiler it also times the same steps plainly (ms per step, best of 5).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GROUPS = [  # (group, op-name substrings), first match wins
    ("linears (dequant-matmul kernels)", ("linear:",)),
    ("lm_head (logits)", ("lm_head",)),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("KV store / gather", ("index_copy", "index_select")),
    ("RMSNorm", ("rms_norm",)),
    ("rotary", ("roll", "addcmul")),
    ("sampler (argmax, softmax)", ("argmax", "softmax", "topk", "sort")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other tensor ops (add, silu, views, copies)"


def instrument(model) -> None:
    """Label every linear call and the logits for the profiler (compiled kernels that are not
    aten ops would otherwise be counted as Python)."""
    from dataclasses import replace

    from torch.profiler import record_function

    def timed(label, fn):
        def call(x):
            with record_function(label):
                return fn(x)
        return call

    from flotilla.kernels.fused import silu_mul

    def labelled(ops):
        gate_up = timed("linear:gate_up", ops.gate_up)
        # the layer calls gate_up through gate_up_act (on the CPU: silu_mul of the product)
        return replace(ops, qkv=timed("linear:qkv", ops.qkv), o=timed("linear:o", ops.o), gate_up=gate_up,
                       gate_up_act=lambda h: silu_mul(gate_up(h)), down=timed("linear:down", ops.down))

    model._frozen = [labelled(ops) for ops in model._frozen]
    logits = model.compute_logits
    model.compute_logits = timed("lm_head", logits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=200, help="tokens in the sequence when profiling")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2 RTN w4 g64, made once: bench/rtn_checkpoint.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    from flotilla.runtime.default_model import default_model_path
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.sampling import SamplingParams
    from bench.cpu_decode import int4_checkpoint

    lm = load_model(args.model or int4_checkpoint(default_model_path(), 64), "cpu", "float32", progress=False)
    engine = build_engine(lm, EngineArgs(kv_cache_memory="256MiB", max_num_seqs=1))
    prompt = lm.tokenizer.encode("Once upon a time")
    total = args.context + 6 * args.steps + 10
    engine.add_request("p", prompt, SamplingParams(max_tokens=total, temperature=0, ignore_eos=True))
    with torch.inference_mode():
        while engine.seqs["p"].num_tokens < args.context:
            engine.step()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            best = min(best, (time.perf_counter() - t) / args.steps)
        instrument(lm.model)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            wall = (time.perf_counter() - t) / args.steps
    groups: dict[str, float] = {}
    for evt in prof.events():
        label, parent = evt.name, evt.cpu_parent
        while parent is not None:  # an op inside a labelled linear counts as that linear
            if parent.name.startswith(("linear:", "lm_head")):
                label = parent.name
            parent = parent.cpu_parent
        g = group_of(label)
        groups[g] = groups.get(g, 0.0) + evt.self_cpu_time_total / 1e3 / args.steps
    groups["Python and framework (wall - ops)"] = max(0.0, wall * 1e3 - sum(groups.values()))
    rows = [{"group": g, "ms_per_step": ms, "share": ms / (wall * 1e3)} for g, ms in
            sorted(groups.items(), key=lambda kv: -kv[1])]
    head = {"context": args.context, "threads": args.threads, "ms_per_step": best * 1e3, "tok_s": 1 / best,
            "ms_per_step_profiled": wall * 1e3}
    if args.json:
        print(json.dumps({"row": "summary", **head}))
        for r in rows:
            print(json.dumps({"row": "group", **r}))
        return 0
    print(f"single-stream decode at {args.context} tokens of context, {args.threads} threads: "
          f"{best * 1e3:.2f} ms/step ({1 / best:.1f} tok/s); profiled {wall * 1e3:.2f} ms/step")
    print(f"{'group':48s} {'ms/step':>8s} {'share':>7s}")
    for r in rows:
        print(f"{r['group']:48s} {r['ms_per_step']:8.2f} {r['share']:7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
