"""Speculative decoding on one GPU: a llama-3-8b-shaped INT4 g128 target, plain decoding against
n-gram prompt lookup and draft models, in one run, with greedy outputs compared token by token.

    python bench/gpu_spec.py                 # the table
    python bench/gpu_spec.py --json          # one JSON object per row
    python bench/gpu_spec.py --batches 1,16 --k 4 --tokens 128

What random weights allow, and what each row measures (say it with the figures):

  plain            the target alone: decode steps through CUDA graphs (the reference tokens)
  ngram            prompt lookup. Each prompt is a random half repeated ("repeat the input"); a
                   random-weight target does not copy its prompt, so acceptance is whatever the
                   target's own greedy loops give: a property of these weights, not of a language
  ngram, eager     the same with verify steps run eagerly (graphs for plain decodes only): what
  verify           replaying verify steps through the decode graphs buys
  draft random     an independent random model of the same vocabulary (1 layer of the 8b shape,
                   another seed): acceptance near zero, so this measures the cost of a useless
                   draft once the per-sequence back-off has turned speculation down
  draft 2 of 32    a designed pair. The draft is the target's own first 2 layers (same modules,
  (eps E)          embedding, final norm and lm_head); the target's layers 2..31 have their
                   o_proj and down_proj scales multiplied by E, so they add E-scaled updates to
                   the residual stream. E = 0: the target computes all 32 layers (every weight
                   byte is still read) but its logits are the draft's, so acceptance is ~100% by
                   construction: the engine's ceiling for a 2-layer draft. E > 0: acceptance
                   falls as the late layers matter more. The acceptance here is chosen, not
                   found: it says how fast the engine turns a given acceptance into tokens, not
                   how well any real draft predicts any real model.

Batch B: B prompts at once (aggregate decode tok/s). `same` compares every request's greedy
tokens with plain decoding of the same target (the eps rows against plain decoding of the
scaled target, measured in the same run). Columns as bench/spec_decode.py: acceptance =
accepted / verified drafts; `per step` = drafts accepted per verify step (each step also yields
the target's own token).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.models.linear import QuantLinear  # noqa: E402
from flotilla.models.llama import CausalLM  # noqa: E402
from flotilla.runtime.cuda_graphs import capture_sizes  # noqa: E402
from flotilla.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from flotilla.runtime.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from flotilla.runtime.model_runner import ModelRunner  # noqa: E402
from flotilla.runtime.random_model import build_random_model  # noqa: E402
from flotilla.runtime.sampling import SamplingParams  # noqa: E402
from flotilla.runtime.scheduler import SchedulerConfig  # noqa: E402
from flotilla.runtime.spec.config import SpeculativeConfig  # noqa: E402
from flotilla.runtime.spec.decoder import SpecDecoder  # noqa: E402
from flotilla.runtime.spec.draft import DraftProposer  # noqa: E402
from flotilla.runtime.spec.ngram import NgramProposer  # noqa: E402

BLOCK = 16


def kv_cache(model: CausalLM, num_blocks: int) -> KVCache:
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    spec = KVCacheSpec(tuple(model.stage.layers), cfg.num_key_value_heads, cfg.head_dim, dtype, BLOCK)
    return KVCache(spec, num_blocks, model.model.embed_tokens.weight.device)


def spec_engine(target: CausalLM, batch: int, context: int, method: str | None, k: int,
                draft: CausalLM | None = None, verify_graphs: bool = True) -> LLMEngine:
    """An engine for `batch` sequences of up to `context` tokens: graphs for decode steps and (with
    `verify_graphs`) for verify steps of up to k drafts a sequence; the draft's passes on graphs too."""
    num_blocks = batch * -(-context // BLOCK) + 1
    query_len = 1 + k if method and verify_graphs else 1
    runner = ModelRunner(target, kv_cache(target, num_blocks), graph_sizes=capture_sizes(batch * query_len),
                         max_model_len=context, graph_query_len=query_len)
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_model_len=context,
                          scheduler=SchedulerConfig(batch, batch * context), enable_prefix_caching=False)
    decoder = None
    if method == "ngram":
        decoder = SpecDecoder(SpeculativeConfig("ngram", k), NgramProposer())
    elif method == "draft":
        n = num_blocks + batch * -(-k // BLOCK)
        proposer = DraftProposer(draft, kv_cache(draft, n), n, graph_sizes=capture_sizes(2 * batch),
                                 graph_query_len=k + 1, max_model_len=context)
        decoder = SpecDecoder(SpeculativeConfig("draft", k, draft_path="(in memory)"), proposer)
    return LLMEngine(runner, config, None, (), target.config.vocab_size, decoder)


def prompts(batch: int, half: int, vocab: int, seed: int) -> list[list[int]]:
    """Random halves, each repeated once: the prompt repeats its input."""
    gen = torch.Generator().manual_seed(seed)
    return [(p + p) for p in torch.randint(0, vocab, (batch, half), generator=gen).tolist()]


@torch.inference_mode()
def decode(engine: LLMEngine, batch_prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list, dict]:
    """Aggregate decode tok/s (after every request has its first token), tokens per request, and
    the speculation counters of this run."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    before = engine.stats()
    ids = [f"{tag}-{i}" for i in range(len(batch_prompts))]
    for rid, p in zip(ids, batch_prompts):
        engine.add_request(rid, p, params)
    out = {rid: [] for rid in ids}
    start, counted = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        for o in outputs:
            out[o.request_id] += o.new_token_ids
            if start is not None:
                counted += len(o.new_token_ids)
        if start is None and all(out.values()):
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    after = engine.stats()
    counters = {f: getattr(after, f) - getattr(before, f)
                for f in ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verify_steps_total",
                          "steps_total")}
    return counted / seconds, [out[r] for r in ids], counters


def shared_draft(target: CausalLM, layers: int) -> CausalLM:
    """A draft made of the target's first `layers` decoder layers and its embedding, final norm,
    lm_head and rope tables (the same modules: no copy)."""
    cfg = dataclasses.replace(target.config, num_hidden_layers=layers)
    with torch.device("meta"):
        draft = CausalLM(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleDict({str(i): target.model.layers[str(i)] for i in range(layers)})
    draft.model.norm = target.model.norm
    draft.model.norm_matrix = target.model.norm_matrix
    draft.lm_head = target.lm_head
    draft.rope = target.rope
    return draft


def scale_late_layers(target: CausalLM, first: int, factor: float) -> None:
    """Multiply the o_proj and down_proj group scales of layers >= first by `factor` (in place,
    in the kernels' repacked layout, which the captured graphs read)."""
    for i, layer in target.model.layers.items():
        if int(i) < first:
            continue
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(lin, QuantLinear) and hasattr(lin.kernel, "layout"), type(lin.kernel)
            lin.kernel.layout.scales.mul_(factor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per step (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--half", type=int, default=48, help="random tokens repeated twice per prompt (default 48)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--eps", default="0.3,0", help="late-layer scale factors of the designed pair, applied in "
                                                   "this order (each multiplies the last; 0 last)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_spec.py needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    k, tokens = args.k, args.tokens
    context = 2 * args.half + tokens + k + 1
    t0 = time.perf_counter()
    target = build_random_model(args.shape, 4, "cuda", torch.float16)
    independent = build_random_model(args.shape, 4, "cuda", torch.float16, seed=1, num_layers=1)
    print(f"device: {torch.cuda.get_device_name(0)}; {args.shape} int4 g128 target built in "
          f"{time.perf_counter() - t0:.1f}s; k={k}, {tokens} tokens, prompts of 2 x {args.half}", flush=True)
    vocab = target.config.vocab_size
    rows: list[dict] = []

    def measure(target_name: str, configs: list[tuple[str, str | None, CausalLM | None, bool]]) -> None:
        for b in batches:
            ps = prompts(b, args.half, vocab, seed=100 + b)
            reference = None
            base = None
            for name, method, draft, verify_graphs in configs:
                t = time.perf_counter()
                engine = spec_engine(target, b, context, method, k, draft, verify_graphs)
                # warm-up as long as the run: compile every shape the run meets (a draft's catch-up
                # passes after a back-off bring 9, 17, 33... tokens), allocate, capture
                decode(engine, prompts(b, args.half, vocab, seed=7), tokens, "warm")
                tps, outs, c = decode(engine, ps, tokens, f"{name}-{b}")
                if reference is None:
                    reference, base = outs, tps
                same = sum(o == r for o, r in zip(outs, reference))
                drafts, acc, steps = (c["spec_draft_tokens_total"], c["spec_accepted_tokens_total"],
                                      c["spec_verify_steps_total"])
                row = {"target": target_name, "method": name, "batch": b, "k": k if method else 0,
                       "decode_tok_s": round(tps, 1), "vs_plain": round(tps / base, 3),
                       "acceptance": round(acc / drafts, 3) if drafts else None,
                       "accepted_per_step": round(acc / steps, 3) if steps else None,
                       "steps": c["steps_total"], "same_requests": same, "requests": b,
                       "setup_s": round(time.perf_counter() - t, 1)}
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print_row(row)
                del engine
                torch.cuda.empty_cache()

    if not args.json:
        print_head()
    measure("random", [("plain", None, None, True), ("ngram", "ngram", None, True),
                       ("ngram, eager verify", "ngram", None, False),
                       ("draft random 1L", "draft", independent, True)])
    del independent
    draft = shared_draft(target, args.draft_layers)
    total = 1.0
    for eps in (float(e) for e in args.eps.split(",")):
        scale_late_layers(target, args.draft_layers, eps / total if total else 0.0)
        total = eps
        measure(f"eps {eps:g}", [("plain", None, None, True),
                                 (f"draft first {args.draft_layers}L", "draft", draft, True),
                                 ("ngram", "ngram", None, True)])
    ok = all(r["same_requests"] == r["requests"] for r in rows)
    print(f"greedy tokens identical to plain decoding in every row: {'yes' if ok else 'NO'}", flush=True)
    return 0 if ok else 1


HEAD = (f"{'target':<8} {'method':<20} {'B':>3} {'k':>2} {'decode tok/s':>12} {'vs plain':>9} {'acceptance':>10} "
        f"{'per step':>8} {'steps':>5} {'same':>7} {'setup s':>7}")


def print_head() -> None:
    print(HEAD)
    print("-" * len(HEAD), flush=True)


def print_row(r: dict) -> None:
    acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
    per = f"{r['accepted_per_step']:.2f}" if r["accepted_per_step"] is not None else "-"
    print(f"{r['target']:<8} {r['method']:<20} {r['batch']:>3} {r['k'] or '-':>2} {r['decode_tok_s']:>12.1f} "
          f"{r['vs_plain']:>8.2f}x {acc:>10} {per:>8} {r['steps']:>5} {r['same_requests']:>3}/{r['requests']:<3} "
          f"{r['setup_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
