"""GPU correctness checks for bench/gpu_decode.py (each returns one line ending in OK or FAIL).

  check_attention  paged attention on CUDA (Triton decode, SDPA prefill) vs the CPU fp32 reference
  check_fused      the Triton small-op kernels vs torch, and the model's logits with them on and off
  check_graphs     decode-graph replays vs the eager runner's logits
  check_prefill    a prefill with the registry's picks vs the same with the tile GEMM left out
  check_linears    every layout-kernel call of a prefill vs dequantize + cuBLAS on its own input (which went wrong)
  check_syncs      host syncs per graph decode step, under torch's sync debug mode (with and without overlap)
  check_overlap    the overlapped engine's tokens against the synchronous engine's (stops, an abort)
  check_engine_spec  `build_engine` on CUDA (what `runtime serve/generate` run) with --speculative
                   ngram and draft:PATH on a small random checkpoint: greedy tokens against plain
                   decoding, acceptance, the graph buckets captured, pool integrity

    python bench/gpu_checks.py        # the checks that need no 8b model (attention, engine_spec)
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from flotilla.kernels.attention import paged_attention, store_kv
from flotilla.runtime.bench import bench_engine, measure
from flotilla.runtime.kv_cache import PagedAttentionBackend
from flotilla.runtime.model_runner import StepInput, prepare_step
from flotilla.runtime.random_model import randomize
from flotilla.runtime.sampler import SamplingBatch
from flotilla.runtime.sampling import SamplingParams


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm()).item()


def step_input(new_tokens: list[list[int]], starts: list[int], tables: list[list[int]]) -> StepInput:
    rows = [(SamplingParams(temperature=0), 0, [], []) for _ in new_tokens]
    return StepInput([f"r{i}" for i in range(len(new_tokens))], [t for ts in new_tokens for t in ts], starts,
                     [len(t) for t in new_tokens], tables, sum(len(t) == 1 for t in new_tokens),
                     [True] * len(new_tokens), SamplingBatch.build(rows))


# ------------------------------------------------------------------------------------- checks

def check_attention(seed: int = 0, hq: int = 32, hkv: int = 8) -> str:
    """One mixed step (decodes with contexts 1..2100, a fresh prefill, a prefill after a cached
    prefix) on llama-3-8b heads (hq=64: llama-3-70b's): CUDA fp16 (Triton decode, SDPA prefill) vs CPU fp32
    reference."""
    gen = torch.Generator().manual_seed(seed)
    d, bs, nblocks = 128, 16, 600
    seqs = [(0, 1), (36, 1), (699, 1), (2099, 1), (0, 50), (30, 20)]  # (cached, new) decodes first
    perm = torch.randperm(nblocks - 1, generator=gen).add(1).tolist()
    tables, starts, tokens = [], [], []
    for cached, new in seqs:
        n = -(-(cached + new) // bs)
        tables.append([perm.pop() for _ in range(n)])
        starts.append(cached)
        tokens.append([0] * new)
    step = step_input(tokens, starts, tables)
    kc = torch.randn(nblocks, bs, hkv, d, generator=gen).half()
    vc = torch.randn(nblocks, bs, hkv, d, generator=gen).half()
    q = torch.randn(step.num_tokens, hq, d, generator=gen).half()
    k = torch.randn(step.num_tokens, hkv, d, generator=gen).half()
    v = torch.randn(step.num_tokens, hkv, d, generator=gen).half()
    outs = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float16)):
        dev = torch.device(device)
        kd, vd = kc.to(dev, dtype), vc.to(dev, dtype)
        _, meta, _ = prepare_step(step, bs, dev)
        store_kv(kd, vd, k.to(dev, dtype), v.to(dev, dtype), meta)
        outs[device] = paged_attention(q.to(dev, dtype), kd, vd, meta, d ** -0.5)
    nd = step.num_decodes
    dec = rel_err(outs["cuda"][:nd], outs["cpu"][:nd])
    pre = rel_err(outs["cuda"][nd:], outs["cpu"][nd:])
    ok = dec < 5e-3 and pre < 5e-3 and bool(torch.isfinite(outs["cuda"]).all())
    return (f"paged attention ({hq} heads over {hkv}), CUDA fp16 vs CPU fp32 reference: decodes (Triton) rel err {dec:.1e}, "
            f"prefills (SDPA) rel err {pre:.1e} -> {'OK' if ok else 'FAIL'}")


def _prefill(model, batch: int, prompt_len: int, seed: int, max_len: int):
    """Random prompts' first step on a fresh eager engine: a function that runs the model over it and returns
    the logits (each call writes the same KV blocks again)."""
    runner = bench_engine(model, batch, max_len, batch * prompt_len, graphs=False).executor
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
    blocks = -(-prompt_len // runner.block_size)
    s = step_input(prompts, [0] * batch, [[1 + b * blocks + i for i in range(blocks)] for b in range(batch)])
    positions, meta, _ = prepare_step(s, runner.block_size, runner.device)
    x = torch.tensor(s.token_ids, dtype=torch.long, device=runner.device)
    return lambda: runner.compute_logits(s, model(x, positions, PagedAttentionBackend(runner.cache, meta, runner.scale)))


@torch.inference_mode()
def check_fused(model, batch: int = 4, prompt_len: int = 32) -> str:
    """The Triton kernels of the small per-layer ops against torch on real shapes (the KV store
    is covered by the attention check), then the whole model's prefill logits with them on and
    off."""
    from flotilla.kernels import fused, triton_fused

    errs = {}
    for dtype in (torch.float16, torch.bfloat16):
        x = 4 * torch.randn(64, 4096, device="cuda", dtype=dtype)
        d = torch.randn_like(x)
        w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=dtype)
        s, y = triton_fused.add_rms_norm(x, d, w, 1e-5)
        ref = F.rms_norm((x + d).float(), (4096,), w.float(), 1e-5)
        alone = rel_err(triton_fused.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (4096,), w.float(), 1e-5))
        errs[f"norm {dtype}"] = max(alone, rel_err(y, ref), 0.0 if torch.equal(s, x + d) else 1.0)
        gu = 2 * torch.randn(64, 2 * 14336, device="cuda", dtype=dtype)
        want = F.silu(gu[:, :14336].float()) * gu[:, 14336:].float()
        errs[f"silu_mul {dtype}"] = rel_err(triton_fused.silu_mul(gu), want)
        qkv = torch.randn(64, 48 * 128, device="cuda", dtype=dtype)
        q = qkv[:, :40 * 128].view(64, 40, 128)
        cos, sin = model.rope.tables(torch.arange(0, 6400, 100, device="cuda"), dtype)
        want = torch.addcmul(q.float() * cos.float(), q.float().roll(64, dims=-1), sin.float())
        errs[f"rope {dtype}"] = rel_err(triton_fused.rope(q, cos, sin), want)
    prefill = _prefill(model, batch, prompt_len, seed=3, max_len=prompt_len + 8)
    logits = {}
    for on in (True, False):
        fused.ENABLED = on
        logits[on] = prefill()
    fused.ENABLED = True
    errs["model logits, fused vs torch ops"] = rel_err(logits[True], logits[False])
    worst = max(v for k, v in errs.items() if not k.startswith("model"))
    ok = worst < 1e-2 and errs["model logits, fused vs torch ops"] < 3e-2
    return ("fused small ops (Triton) vs torch: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            + f" -> {'OK' if ok else 'FAIL'}")


@torch.inference_mode()
def check_graphs(model, batch: int = 5, prompt_len: int = 40, steps: int = 3) -> str:
    """Decode steps through the graph of bucket 8 (3 padding rows) against the eager runner's
    logits on the same cache."""
    engine = bench_engine(model, batch, prompt_len + steps + 1, batch * prompt_len)
    runner = engine.executor
    assert runner.graphs is not None, "no CUDA graphs were captured"
    bs = runner.block_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
    blocks = -(-(prompt_len + steps + 1) // bs)
    tables = [[1 + b * blocks + i for i in range(blocks)][::-1] for b in range(batch)]  # not consecutive

    def eager(s: StepInput) -> torch.Tensor:
        positions, meta, _ = prepare_step(s, bs, runner.device)
        x = torch.tensor(s.token_ids, dtype=torch.long, device=runner.device)
        return runner.compute_logits(s, model(x, positions, PagedAttentionBackend(runner.cache, meta, runner.scale)))

    tokens = eager(step_input(prompts, [0] * batch, tables)).argmax(-1).tolist()
    errs, agree = [], 0
    for i in range(steps):
        s = step_input([[t] for t in tokens], [prompt_len + i] * batch, tables)
        want = eager(s)  # writes this step's keys and values; the replay writes the same again
        got = runner.graphs.run(s.token_ids, s.starts, s.block_tables, s.query_lens)
        errs.append(rel_err(got, want))
        agree += sum(a == b for a, b in zip(got.argmax(-1).tolist(), want.argmax(-1).tolist()))
        tokens = want.argmax(-1).tolist()
    ok = max(errs) < 1e-2
    return (f"decode graphs (batch {batch} in bucket 8) vs eager runner: logits rel err max {max(errs):.1e}, "
            f"greedy tokens agree {agree}/{batch * steps} -> {'OK' if ok else 'FAIL'}")


def _layout_kernels(model) -> list:
    """The model's Triton-layout kernel objects (the ones that hold Hopper's tile GEMM)."""
    from flotilla.kernels.triton_linear import TritonLayoutKernel
    return [k for k in (getattr(m, "kernel", None) for m in model.modules()) if isinstance(k, TritonLayoutKernel)]


@torch.inference_mode()
def check_tile_silu(model, rows=(9, 12, 16)) -> str:
    """The Triton tiles' silu epilogue on the model's first gate_up weight (silu_mul where the registry picks a
    "dot" config) against its product, then kernels/fused.silu_mul: equal within an fp16 ulp."""
    from flotilla.kernels.fused import silu_mul

    kern = next(m.kernel for name, m in model.named_modules() if name.endswith("gate_up_proj"))
    gen = torch.Generator(device="cuda").manual_seed(4)
    worst, fused = 0.0, []
    for m in rows:
        if kern.config_for(m).kind != "dot" or not kern.fuses_silu(m):
            continue
        x = torch.randn(m, kern.layout.in_features, device="cuda", dtype=torch.float16, generator=gen)
        got, want = kern.silu_mul(x), silu_mul(kern(x))
        worst = max(worst, float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()))
        fused.append(m)
    if not fused:
        return "tile silu epilogue: not picked at these rows (FLOTILLA_TILE_SILU=0, or the GEMV serves them) -> OK"
    ok = worst <= 2e-3
    return (f"tile silu epilogue at rows {fused} vs the product then silu_mul: max rel diff "
            f"{worst:.1e} -> {'OK' if ok else 'FAIL'}")


@torch.inference_mode()
def check_prefill(model, batch: int = 5, prompt_len: int = 40) -> str:
    """One prefill of batch x prompt_len rows with the registry's picks (on Hopper the tile GEMM from 128 rows,
    split-K on narrow weights) against the same prefill with the tile GEMM left out (the Triton tiles or
    dequantize + cuBLAS): both finite, and equal within rounding. The decode checks share one prefill between
    the two sides they compare, so they cannot see a wrong one."""
    logits = _prefill(model, batch, prompt_len, seed=2, max_len=prompt_len + 1)
    kernels = _layout_kernels(model)
    tiles = [k.tile for k in kernels]
    picks = {k.config_for(batch * prompt_len).kind for k in kernels}
    got = logits()
    try:
        for k in kernels:
            k.tile = None
            k._configs.clear()
        want = logits()
    finally:
        for k, t in zip(kernels, tiles):
            k.tile = t
            k._configs.clear()
    bad = [name for name, t in (("picks", got), ("without the tile GEMM", want)) if not bool(torch.isfinite(t).all())]
    err = rel_err(got, want) if not bad else float("nan")
    ok = not bad and err < 1e-2
    return (f"prefill of {batch * prompt_len} rows, the registry's picks ({'/'.join(sorted(picks)) or 'no layout kernels'}) vs the tile GEMM "
            f"left out: logits rel err {err:.1e}" + (f", not finite: {', '.join(bad)}" if bad else "")
            + f" -> {'OK' if ok else 'FAIL'}")


@torch.inference_mode()
def check_linears(model, batch: int = 5, prompt_len: int = 40) -> str:
    """Every layout-kernel call of one prefill against dequantize + cuBLAS on the same input (the call's own
    input, so a bad linear shows where it is, not downstream): per call its config, and whether the input
    and output are finite. Says which call first went wrong (the diagnostic behind a failing check_prefill)."""
    from flotilla.kernels.triton_linear import GemmConfig, TritonLayoutKernel

    prefill = _prefill(model, batch, prompt_len, seed=2, max_len=prompt_len + 1)
    calls: list[tuple] = []
    inner = TritonLayoutKernel.__call__

    def checked(self, x, bias=None, config=None, out=None):
        y = inner(self, x, bias, config, out)
        cfg = config or self.config_for(x.reshape(-1, x.shape[-1]).shape[0])
        if cfg.kind != "dense":
            want = inner(self, x, bias, GemmConfig("dense"))
            got = out if out is not None else y
            lay = self.layout
            calls.append((len(calls), f"{lay.in_features}x{lay.out_features}", cfg, bool(torch.isfinite(x).all()),
                          bool(torch.isfinite(got).all()), rel_err(got.reshape(want.shape), want)))
        return y

    TritonLayoutKernel.__call__ = checked
    try:
        prefill()
    finally:
        TritonLayoutKernel.__call__ = inner
    if not calls:
        return "linears: no layout-kernel calls in the prefill -> FAIL"
    bad = [c for c in calls if not c[4] or not c[5] < 1e-2]
    worst = max(calls, key=lambda c: c[5] if c[5] == c[5] else float("inf"))
    kinds = sorted({f"{c[2].kind}/{c[2].block_m}/{c[2].split_k}" for c in calls})
    line = (f"linears of a {batch * prompt_len}-row prefill vs dequantize + cuBLAS: {len(calls)} calls ({', '.join(kinds)}), "
            f"worst rel err {worst[5]:.1e} ({worst[1]}, {worst[2].kind} rows {worst[2].block_m} splits {worst[2].split_k})")
    if bad:
        i, shape, cfg, fin_in, fin_out, err = bad[0]
        line += (f"; {len(bad)} bad, the first: call {i} {shape} {cfg.kind} rows {cfg.block_m} splits {cfg.split_k}, "
                 f"input {'finite' if fin_in else 'NOT finite'}, output {'finite' if fin_out else 'NOT finite'}, rel err {err:.1e}")
    return line + (" -> FAIL" if bad else " -> OK")


@torch.inference_mode()
def check_syncs(model, batch: int = 4, prompt_len: int = 16, steps: int = 8, overlap: bool = False) -> str:
    """Decode steps through the engine under torch's sync debug mode: every synchronising CUDA
    call warns. Without overlap the graph path makes one per step (the sampler's `tolist`); with
    it, none (the host waits on an event for the pinned copy of the ids), and the device still
    has work queued when `step()` returns (the next step was launched before the wait)."""
    import warnings

    engine = bench_engine(model, batch, prompt_len + steps + 8, batch * prompt_len, overlap=overlap)
    measure(engine, batch, prompt_len, 4, seed=7)  # warm-up
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"sync-{i}", list(range(1 + i, prompt_len + 1 + i)), params)
    engine.step()  # the prefill, eager
    torch.cuda.synchronize()
    busy = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            n = 0
            while engine.has_unfinished():
                engine.step()
                n += 1
                busy += not torch.cuda.current_stream().query()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:100] for w in caught
             if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    kinds = sorted(set(syncs))
    ok = busy >= n - 2 and len(syncs) <= n if overlap else 0 < len(syncs) <= n
    return (f"{'overlap' if overlap else 'sync'}: host syncs in {n} graph decode steps at batch {batch}: {len(syncs)} "
            f"({'; '.join(kinds) or 'none reported'}); device busy when step() returned: {busy}/{n} "
            f"-> {'OK' if ok else 'CHECK'}")


@torch.inference_mode()
def check_overlap(model, batch: int = 6, prompt_len: int = 24, tokens: int = 24) -> str:
    """The overlapped engine (each decode launched before the last one's tokens are read, its
    tokens read on the device) against the synchronous one, on one engine with graphs for
    buckets 1, 2, 4, 8: greedy and seeded requests, stop tokens met mid-way (taken from a first
    run), max_tokens, one request aborted. Tokens and finish reasons must be identical; the pool
    must be whole after each run."""
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
    engine = bench_engine(model, batch, prompt_len + tokens + 1, batch * prompt_len, sizes=(1, 2, 4, 8))

    def run(overlap: bool, params: list[SamplingParams], abort: tuple[int, str] | None = None):
        engine.overlap = overlap
        out = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"o{i}", p, sp)
            out[f"o{i}"] = ([], None)
        n = 0
        while engine.has_unfinished():
            if abort is not None and n == abort[0]:
                engine.abort(abort[1])
                out[abort[1]] = (out[abort[1]][0], "abort")
            for o in engine.step():
                out[o.request_id] = (out[o.request_id][0] + o.new_token_ids, o.finish_reason)
            n += 1
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
        return out

    params = [SamplingParams(max_tokens=tokens - 2 * (i % 3), temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                             ignore_eos=True) for i in range(batch)]
    free = run(False, params)
    for i in (0, 1, 3):  # stop tokens that a first run met mid-way
        params[i] = SamplingParams(**{**params[i].__dict__, "stop_token_ids": (free[f"o{i}"][0][4 + 3 * i],)})
    want = run(False, params, abort=(7, "o4"))
    got = run(True, params, abort=(7, "o4"))
    same = sum(got[k] == want[k] for k in want)
    reasons = sorted({r for _, r in want.values()})
    ok = same == batch and reasons == ["abort", "length", "stop"]
    return (f"overlap vs synchronous engine (batch {batch}, buckets 1-8, greedy + seeded, stops, an abort): "
            f"{same}/{batch} requests identical, finish reasons {reasons} -> {'OK' if ok else 'FAIL'}")


def _save_random_llama(directory: Path, layers: int, seed: int) -> Path:
    """A random-weight Llama checkpoint (fp16 safetensors) of a small shape, written here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, torch_dtype="float16")
    model = randomize(LlamaForCausalLM(cfg).eval())
    model.half().save_pretrained(str(directory), safe_serialization=True)
    return directory


def check_engine_spec(batch: int = 8, k: int = 4, tokens: int = 48, device: str = "cuda", dtype: str = "float16") -> str:
    """Engines built by `build_engine` on CUDA: plain, n-gram, a draft that is the target's own
    checkpoint (every draft is right: acceptance 100% by construction) and an unrelated 1-layer
    draft; prompts repeat a random half. Greedy tokens must equal plain decoding's."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="flotilla-gpu-check-"))
    target = _save_random_llama(tmp / "target", 4, 0)
    other = _save_random_llama(tmp / "other", 1, 1)
    lm = load_model(target, device, dtype, with_tokenizer=False, progress=False)
    halves = torch.randint(3, 512, (batch, 24), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [h + h for h in halves]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    parts, ok, plain = [], True, None
    for name, spec in (("plain", None), ("ngram", "ngram"), ("draft=target", f"draft:{target}"),
                       ("draft 1L other", f"draft:{other}")):
        engine = build_engine(lm, EngineArgs(kv_cache_memory="256MiB", max_num_seqs=batch, max_model_len=256,
                                             speculative=spec, num_speculative_tokens=k))
        out = generate(engine, prompts, params)
        engine.check_integrity()
        st = engine.stats()
        plain = plain or out
        same = sum(a == b for a, b in zip(out, plain))
        ok &= same == batch
        sizes = engine.executor.graphs.sizes if engine.executor.graphs is not None else ()
        draft = getattr(engine.spec.proposer, "runner", None) if engine.spec is not None else None
        dsizes = draft.graphs.sizes if draft is not None and draft.graphs is not None else None
        parts.append(f"{name}: same {same}/{batch}, acceptance {st.spec_acceptance_rate:.0%}, graphs {sizes}"
                     + (f", draft graphs {dsizes}" if dsizes is not None else ""))
    return f"engine (build_engine) on {device}: " + "; ".join(parts) + f" -> {'OK' if ok else 'FAIL'}"


if __name__ == "__main__":
    print(check_attention(), flush=True)
    print(check_engine_spec(), flush=True)
    sys.exit(0)
