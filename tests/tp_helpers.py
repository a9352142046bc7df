"""Helpers of the tensor-parallel tests: tiny fp32 and INT4 models (INT4 with plain or act-order
groups), the ranks' bodies for torch.multiprocessing, and greedy decoding through the engine."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from flotilla.kernels.gptq import GPTQWeight, default_g_idx
from flotilla.models.checkpoint import TOKENIZER_FILES, CheckpointWriter
from flotilla.models.config import QuantConfig
from flotilla.models.sources import open_source

from quantize_helpers import cli_env

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
PROMPTS = [[5, 17, 42, 99, 3], [7] * 23, list(range(60, 100)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [33], [90, 91]]


def rtn_groups(weight: torch.Tensor, g_idx: torch.Tensor, group_size: int, bits: int = 4) -> GPTQWeight:
    """Symmetric round-to-nearest of weight [out, in] over the groups g_idx gives each input row."""
    w = weight.t().float()  # [in, out]
    groups = int(g_idx.max()) + 1
    scales = torch.stack([w[g_idx == g].abs().amax(dim=0) for g in range(groups)]) / (2 ** (bits - 1) - 1)
    scales = scales.clamp(min=1e-8).half().float()  # [G, out], the stored precision
    zero = 2 ** (bits - 1)
    q = (w / scales[g_idx.long()]).round().clamp(-zero, zero - 1) + zero
    zeros = torch.full((groups, w.shape[1]), zero, dtype=torch.int32)
    return GPTQWeight.from_codes(q.to(torch.int32), zeros, scales, g_idx, bits, group_size)


def write_int4(src: Path, out: Path, group_size: int, act_order: bool = False, seed: int = 0) -> Path:
    """An INT4 GPTQ-layout checkpoint of the model in `src`. With act_order, each input axis gets a
    random permutation of its groups' rows (shared by the projections that read that input, as
    GPTQ's act-order leaves q/k/v and gate/up)."""
    source = open_source(src)
    cfg = source.config.with_quant(QuantConfig(bits=4, group_size=group_size, desc_act=act_order, method="rtn"))
    gen = torch.Generator().manual_seed(seed)

    def g_idx_for(n_in: int) -> torch.Tensor:
        g = default_g_idx(n_in, group_size)
        return g[torch.randperm(n_in, generator=gen)] if act_order else g

    with CheckpointWriter(out, cfg, force=True) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": source.get("model.embed_tokens.weight")})
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            shared = {"attn": g_idx_for(cfg.hidden_size), "mlp": g_idx_for(cfg.hidden_size)}
            tensors = {}
            for proj in PROJECTIONS:
                weight = source.get(f"{p}{proj}.weight")
                g = {"q_proj": shared["attn"], "k_proj": shared["attn"], "v_proj": shared["attn"],
                     "gate_proj": shared["mlp"], "up_proj": shared["mlp"]}.get(proj.split(".")[1])
                gw = rtn_groups(weight, g if g is not None else g_idx_for(weight.shape[1]), group_size)
                for suffix in ("qweight", "qzeros", "scales", "g_idx"):
                    tensors[f"{p}{proj}.{suffix}"] = getattr(gw, suffix).clone()
            for norm in NORMS:
                tensors[f"{p}{norm}.weight"] = source.get(f"{p}{norm}.weight")
            w.add_layer(str(i), tensors)
        head = {"model.norm.weight": source.get("model.norm.weight")}
        if not cfg.tie_word_embeddings:
            head["lm_head.weight"] = source.get("lm_head.weight")
        w.add_layer("head", head)
        w.copy_files(src, TOKENIZER_FILES)
        return w.commit()


def logits_of(model, ids: torch.Tensor, batch: int) -> torch.Tensor:
    """fp32 logits [B * L, vocab] of `batch` equal-length sequences, flattened."""
    from flotilla.models.attention import DenseCausalAttention

    seq_len = ids.numel() // batch
    positions = torch.arange(seq_len).repeat(batch)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, DenseCausalAttention(batch, seq_len)))


def token_batch(vocab: int, batch: int = 2, seq_len: int = 9) -> torch.Tensor:
    return torch.randint(0, vocab, (batch * seq_len,), generator=torch.Generator().manual_seed(11))


def rank_logits(rank: int, world: int, init: str, model_dirs: list[str], out_dir: str) -> None:
    """One rank: for every model, its TP share's logits by the module path (live modules) and by the
    runtime's frozen path (per-layer callables, the CPU logits kernel); a two-stage split of the
    first model too. Rank 0 saves what it received."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from flotilla.models.llama import Stage
    from flotilla.models.parallel_state import TPGroup, tensor_parallel
    from flotilla.models.weights import load_stage
    from flotilla.runtime.model_runner import logits_kernel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = TPGroup(rank, world)
    out = {}
    for i, d in enumerate(model_dirs):
        with tensor_parallel(group):
            model = load_stage(open_source(d))
        ids = token_batch(model.config.vocab_size)
        out[f"{i}.live"] = logits_of(model, ids, 2)
        model.freeze(logits_kernel(model, torch.device("cpu")))
        out[f"{i}.frozen"] = logits_of(model, ids, 2)
        if rank == 0:  # the TP=1 references by the same code as the TP logits (the parent's may predate an edit)
            whole = load_stage(open_source(d))
            out[f"{i}.tp1"] = logits_of(whole, ids, 2)
            whole.freeze(logits_kernel(whole, torch.device("cpu")))
            out[f"{i}.tp1.frozen"] = logits_of(whole, ids, 2)
        if i == 0:  # pipeline stages, each split over the same group
            n = model.config.num_hidden_layers
            with tensor_parallel(group):
                first, last = (load_stage(open_source(d), Stage(0, 1, n)), load_stage(open_source(d), Stage(1, n, n)))
            from flotilla.models.attention import DenseCausalAttention

            positions = torch.arange(9).repeat(2)
            with torch.inference_mode():
                h = first(ids, positions, DenseCausalAttention(2, 9))
                out[f"{i}.stages"] = last.compute_logits(last(h, positions, DenseCausalAttention(2, 9)))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "logits.safetensors"))
    else:
        assert all(v.shape[1] == 0 for v in out.values())  # only rank 0 receives the logits
    # Leave together, and without tearing gloo down: a rank that destroys its process group (or
    # runs the interpreter's teardown, which destroys it) while its peer still works on the pairs'
    # sockets can abort in gloo's threads ("terminate called without an active exception"). The
    # barrier alone did not stop that: a fresh-clone CI run on 2026-12-04 lost rank 1 so, after
    # the work was done. Past the barrier neither rank has anything left to do, so each leaves at
    # once with status 0 (rank 0's file is written and closed).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def greedy_tokens(model_dir: str, tp: int, max_tokens: int = 12) -> list[list[int]]:
    """Greedy decoding of PROMPTS through the engine (continuous batching, chunked prefill)."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.sampling import SamplingParams
    from flotilla.runtime.tp import load_model_parallel

    lm = load_model_parallel(model_dir, "cpu", None, tp=tp)
    try:
        engine = build_engine(lm, EngineArgs(kv_cache_memory="8MiB", max_num_seqs=4, max_num_batched_tokens=16))
        return generate(engine, PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        if lm.parallel is not None:
            lm.parallel.close()


def prompt_logprobs(model_dir: str, tp: int) -> list[list]:
    """The prompt logprobs of PROMPTS (top 3) through the engine, 16-token prefill chunks: per prompt,
    [None, (logprob, rank, [[id, logprob], ...]), ...]."""
    from flotilla.runtime.engine_args import EngineArgs, build_engine
    from flotilla.runtime.sampling import SamplingParams
    from flotilla.runtime.tp import load_model_parallel

    lm = load_model_parallel(model_dir, "cpu", None, tp=tp)
    try:
        engine = build_engine(lm, EngineArgs(kv_cache_memory="8MiB", max_num_seqs=4, max_num_batched_tokens=16))
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    got[out.request_id] = out.prompt_logprobs
        return [got[str(i)] for i in range(len(PROMPTS))]
    finally:
        if lm.parallel is not None:
            lm.parallel.close()


def staged_greedy_tokens(model_dir: str, max_tokens: int = 12) -> list[list[int]]:
    """Greedy decoding through two pipeline stages in this process: layer 0 on one device, the
    rest a TP=2 group whose executor receives stage 0's hidden states (broadcast to rank 1)."""
    from flotilla.models.llama import Stage
    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.kv_cache import KVCache, KVCacheSpec
    from flotilla.runtime.loader import load_model
    from flotilla.runtime.model_runner import ModelRunner
    from flotilla.runtime.sampling import SamplingParams
    from flotilla.runtime.tp import load_model_parallel

    n = open_source(model_dir).config.num_hidden_layers
    first = load_model(model_dir, "cpu", None, Stage(0, 1, n), with_tokenizer=False)
    rest = load_model_parallel(model_dir, "cpu", None, tp=2, stage=Stage(1, n, n))
    try:
        engine = build_engine(rest, EngineArgs(kv_cache_memory="8MiB", max_num_seqs=4, max_num_batched_tokens=16))
        spec = KVCacheSpec((0,), first.model.num_kv_heads, first.config.head_dim, first.dtype, engine.config.block_size)
        stage0 = ModelRunner(first.model, KVCache(spec, engine.config.num_blocks, first.device))

        class TwoStages:
            def __init__(self, tp_executor):
                self.tp_executor = tp_executor

            def execute(self, step):
                return self.tp_executor.execute(step, stage0.execute(step))

        engine.executor = TwoStages(engine.executor)
        return generate(engine, PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        rest.parallel.close()


def kill_a_rank_mid_run(model_dir: str) -> dict:
    """TP=2 generating; rank 1 is killed while a long run is in flight. What rank 0's step does:
    it must raise at once (gloo sees the peer gone), never hang."""
    import signal
    import threading
    import time

    from flotilla.runtime.engine_args import EngineArgs, build_engine, generate
    from flotilla.runtime.sampling import SamplingParams
    from flotilla.runtime.tp import load_model_parallel

    lm = load_model_parallel(model_dir, "cpu", None, tp=2)
    engine = build_engine(lm, EngineArgs(kv_cache_memory="8MiB", max_num_seqs=4))
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)  # ~1000 steps in all
    generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))  # both ranks are up
    victim = lm.parallel.procs[0]
    threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        generate(engine, [[4, 5, 6]] * 16, params)
        outcome = "finished"
    except Exception as e:  # noqa: BLE001 - what it raises is the result
        outcome = type(e).__name__
    result = {"outcome": outcome, "seconds": time.monotonic() - start}
    lm.parallel.close()
    return result


if __name__ == "__main__":  # python tp_helpers.py TP MODEL_DIR...: greedy tokens per model as JSON
    if sys.argv[1] == "kill":
        print(json.dumps(kill_a_rank_mid_run(sys.argv[2])))
    elif sys.argv[1] == "prompt":
        print(json.dumps(prompt_logprobs(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1] == "stages":
        print(json.dumps(staged_greedy_tokens(sys.argv[2])))
    else:
        tp = int(sys.argv[1])
        print(json.dumps({d: greedy_tokens(d, tp) for d in sys.argv[2:]}))


def start_tp_server(model, *extra: str):
    """`runtime serve MODEL --tp 2` on the CPU on a free port, as a user starts it: (the process, its base URL, read
    from its start line). The caller stops the process."""
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.server.cli", "serve", str(model), "--tp", "2", "--port",
                             "0", "--device", "cpu", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env())
    for line in proc.stdout:
        m = re.search(r"OpenAI API at (http://\S+)/v1", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError(proc.stderr.read()[-3000:])
