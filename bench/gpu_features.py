"""Correctness checks of features that have not run on a GPU yet (each returns one line ending in OK or FAIL).
The oracle is transformers in fp32 on the CPU over the same weights: an implementation that shares no code
with flotilla's model, kernels or engine.

  check_prompt_logprobs  SamplingParams.prompt_logprobs through `build_engine` (what `runtime serve/generate`
                         build; CUDA graphs on) on a random INT4 Llama (GPTQ layout, RTN codes): a 600-token
                         prompt (logits in three 256-row pieces), the same prompt with the prefix cache warm,
                         max_tokens 0, and two such requests batched beside a plain one; every prompt token's
                         logprob, its rank and the top-k against LlamaForCausalLM over the dequantized weights
                         (codes times scales, computed here), and the greedy tokens where the margins are clear
  check_qwen3            a random dense Qwen3 (q/k RMSNorm before rope, heads * head_dim != hidden) through the
                         engine (paged attention, decode graphs): the prompts' logprobs and greedy continuations
                         of two batched requests against Qwen3ForCausalLM
  check_server           the aiohttp server in-process on loopback, over the INT4 Llama with a byte-level
                         tokenizer built here (<think> and </think> added tokens): /tokenize and /detokenize round
                         trip, /tokenizer_info, completions echo + logprobs + max_tokens 0 against the engine's own
                         prompt logprobs and the oracle, chat with --reasoning-parser qwen3 against a plain
                         completion of the same prompt

    PYTHONPATH=. python3 -P bench/gpu_features.py                  # cuda, float16
    PYTHONPATH=. python3 -P bench/gpu_features.py --device cpu     # float32: the comparisons are tight
    PYTHONPATH=. python3 -P bench/gpu_features.py --only qwen3,server
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import math
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from flotilla.kernels.gptq import GPTQWeight, default_g_idx
from flotilla.models.checkpoint import TOKENIZER_FILES, CheckpointWriter, gptq_tensors, layer_key
from flotilla.models.config import QuantConfig
from flotilla.models.sources import open_source
from flotilla.runtime.engine_args import EngineArgs, build_engine
from flotilla.runtime.loader import load_model
from flotilla.runtime.random_model import randomize
from flotilla.runtime.sampling import SamplingParams

VOCAB = 512  # the models' and the byte tokenizer's (256 bytes, <think>, </think>, 254 filler tokens)
THINK, END_THINK = 256, 257
GROUP = 128  # INT4 group size: every linear's input (256, 512) is a multiple of it
KV = "256MiB"  # a fixed KV budget: no 90%-of-the-GPU cache for a model this small
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant><think>\n{% endif %}")  # opens the block: Thinking-2507's


@dataclass(frozen=True)
class Tolerance:
    """How far the engine's logprobs may be from the fp32 oracle's, and the gap between two of the oracle's values
    under which their order is not asked of the engine (top-k ids, ranks, greedy tokens)."""
    logprob: float
    margin: float


TOLERANCE = {torch.float32: Tolerance(2e-3, 1e-2), torch.float16: Tolerance(0.05, 0.1),
             torch.bfloat16: Tolerance(0.3, 0.5)}


# ------------------------------------------------------------------------------------- models

def _randomize(model, seed: int):
    """random_model.randomize's weights, each a float16 value, so that an fp16 engine holds the oracle's exactly."""
    torch.manual_seed(seed)
    randomize(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model.eval()


def _int4(weight: torch.Tensor) -> tuple[GPTQWeight, torch.Tensor]:
    """An nn.Linear weight [out, in] -> its RTN INT4 codes in the GPTQ layout (symmetric, zero 8), and the dense
    weight [out, in] those codes stand for (codes - 8) * scale, computed here, not by flotilla."""
    w = weight.detach().float().t()  # [in, out]
    n_in, n_out = w.shape
    groups = w.reshape(n_in // GROUP, GROUP, n_out)  # [G, gs, out]
    scales = (groups.abs().amax(dim=1) / 7).clamp(min=1e-8).half().float()  # [G, out], as stored (fp16)
    q = (groups / scales[:, None, :]).round().clamp(-8, 7)  # [G, gs, out]
    dense = (q * scales[:, None, :]).reshape(n_in, n_out).t().contiguous()  # [out, in]
    zeros = torch.full((n_in // GROUP, n_out), 8, dtype=torch.int32)
    packed = GPTQWeight.from_codes((q + 8).to(torch.int32).reshape(n_in, n_out), zeros, scales,
                                   default_g_idx(n_in, GROUP), 4, GROUP)
    return packed, dense


def _byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer of VOCAB tokens, built offline: the 256 bytes, <think> and </think> (added
    tokens, as Qwen3's), then filler added tokens up to the model's vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
                   + [AddedToken(f"<|x{i}|>", special=False) for i in range(VOCAB - 258)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


@functools.cache
def _int4_llama(root: Path):
    """A random Llama (4 layers, hidden 256) as an INT4 flotilla checkpoint with the byte tokenizer, and the
    transformers model in fp32 holding the dequantized weights (the oracle). Built once per run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    hf = _randomize(LlamaForCausalLM(cfg), seed=0)
    packed = {}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                packed[name], dense = _int4(module.weight)
                module.weight.copy_(dense)
    dense_dir = root / "llama-dense"
    hf.save_pretrained(str(dense_dir), safe_serialization=True)
    _byte_tokenizer(dense_dir)
    config = open_source(dense_dir).config.with_quant(QuantConfig(bits=4, group_size=GROUP, sym=True, method="rtn"))
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf.state_dict().items():
        module = name.removesuffix(".weight")
        tensors = gptq_tensors(module, packed[module]) if module in packed else {name: t}
        layers.setdefault(layer_key(name), {}).update(tensors)
    with CheckpointWriter(root / "llama-int4", config) as writer:
        for key in ["embed", *map(str, range(cfg.num_hidden_layers)), "head"]:
            writer.add_layer(key, layers[key])
        writer.copy_files(dense_dir, TOKENIZER_FILES)
        path = writer.commit()
    return path, hf


def _qwen3(root: Path):
    """A random dense Qwen3 (3 layers, hidden 256, 4 heads of 128: q/k norms, heads * head_dim != hidden)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, vocab_size=VOCAB, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    hf = _randomize(Qwen3ForCausalLM(cfg), seed=1)
    hf.save_pretrained(str(root / "qwen3"), safe_serialization=True)
    return root / "qwen3", hf


# ------------------------------------------------------------------------------------- comparisons

@torch.inference_mode()
def _oracle(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [P - 1, vocab] in fp32: row p is the distribution of the token at p + 1."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


@dataclass
class Diff:
    """A prompt's logprobs against the oracle's."""
    worst: float = 0.0  # max |logprob - oracle's| over the prompt tokens and the top-k entries
    wrong: int = 0  # top-k ids or ranks unlike the oracle's where its margins are clear
    problem: str = ""  # a wrong shape: what differed

    @property
    def ok(self) -> bool:
        return not self.problem and self.wrong == 0

    def __str__(self) -> str:
        return self.problem or f"max diff {self.worst:.1e}" + (f", {self.wrong} top-k/rank wrong" if self.wrong else "")


def _compare(entries: list | None, want: torch.Tensor, prompt: list[int], k: int, margin: float) -> Diff:
    """RequestOutput.prompt_logprobs (None, then (logprob, rank, [(id, logprob)] * k) per token) against the
    oracle's rows."""
    if entries is None:
        return Diff(problem="no prompt_logprobs")
    if len(entries) != len(prompt) or entries[0] is not None:
        return Diff(problem=f"{len(entries)} entries (want {len(prompt)}), the first {entries[0]!r} (want None)")
    d = Diff()
    for p, (lp, rank, top) in enumerate(entries[1:]):
        row, token = want[p], prompt[p + 1]
        if len(top) != k:
            return Diff(problem=f"position {p + 1}: {len(top)} top entries, want {k}")
        d.worst = max(d.worst, abs(lp - row[token].item()), *(abs(v - row[t].item()) for t, v in top))
        vals, ids = row.topk(k + 1)
        for j, (t, _) in enumerate(top):  # the j-th likeliest, where the oracle's j-th is clear of its neighbours
            clear = vals[j] - vals[j + 1] > margin and (j == 0 or vals[j - 1] - vals[j] > margin)
            d.wrong += bool(clear and t != ids[j])
        lo, hi = int((row > row[token] + margin).sum()) + 1, int((row > row[token] - margin).sum())
        d.wrong += not lo <= rank <= hi
    if not math.isfinite(d.worst):
        d.problem = "not finite"
    return d


@torch.inference_mode()
def _greedy_wrong(hf, prompt: list[int], tokens: list[int], margin: float) -> tuple[int, int]:
    """Greedy tokens against the oracle teacher-forced along them: (tokens that are not its argmax where its
    top-2 gap is above `margin`, such clear positions)."""
    if not tokens:
        return 0, 0
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()  # [N, vocab]
    top = logits.topk(2)
    clear = top.values[:, 0] - top.values[:, 1] > margin
    wrong = clear & (top.indices[:, 0] != torch.tensor(tokens))
    return int(wrong.sum()), int(clear.sum())


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Add the requests, step until all finish: each request's RequestOutputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _graphs(engine) -> str:
    g = engine.executor.graphs
    return f"graphs {tuple(g.sizes)}" if g is not None else "no graphs"


def _verdict(ok: bool) -> str:
    return "OK" if ok else "FAIL"


# ------------------------------------------------------------------------------------- checks

def check_prompt_logprobs(root: Path, device: str, dtype: torch.dtype, k: int = 5) -> str:
    """Prompt logprobs of the INT4 Llama through the engine `runtime serve` builds, against the fp32 oracle:
    (a) a 600-token prompt, (b) it again with the prefix cache holding it (must not be read: the same result),
    (c) max_tokens 0, (d) two prompt-logprob requests batched beside a plain greedy one."""
    tol = TOLERANCE[dtype]
    path, hf = _int4_llama(root)
    lm = load_model(path, device, str(dtype).removeprefix("torch."), with_tokenizer=False, progress=False)
    engine = build_engine(lm, EngineArgs(kv_cache_memory=KV))
    g = torch.Generator().manual_seed(11)
    long, short, other = (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (600, 300, 200))
    want = {"long": _oracle(hf, long), "short": _oracle(hf, short)}

    def asked(max_tokens: int) -> SamplingParams:
        return SamplingParams(prompt_logprobs=k, max_tokens=max_tokens, temperature=0, ignore_eos=True)

    parts, ok = [], True
    a = _run(engine, {"a": (long, asked(4))})["a"]
    b = _run(engine, {"b": (long, asked(4))})["b"]
    warm = _run(engine, {"warm": (long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))})["warm"]
    da, db = (_compare(x[0].prompt_logprobs, want["long"], long, k, tol.margin) for x in (a, b))
    gap = (max(abs(x[0] - y[0]) for x, y in zip(a[0].prompt_logprobs[1:], b[0].prompt_logprobs[1:]))
           if not (da.problem or db.problem) else float("inf"))
    wa = _greedy_wrong(hf, long, _tokens(a), tol.margin)
    cached = warm[-1].num_cached_tokens
    ok &= da.ok and db.ok and max(da.worst, db.worst) <= tol.logprob and gap <= tol.logprob / 10
    ok &= wa[0] == 0 and _tokens(a) == _tokens(b) and len(_tokens(a)) == 4 and cached > 0
    parts.append(f"(a) 600 tokens: {da}, greedy wrong {wa[0]}/{wa[1]} clear; (b) cache warm: {db}, "
                 f"{'identical to (a)' if gap == 0 else f'differs from (a) by {gap:.1e}'}"
                 + ("" if _tokens(a) == _tokens(b) else ", other greedy tokens")
                 + f"; a plain request then read {cached} cached tokens")
    (c,) = _run(engine, {"c": (short, asked(0))})["c"]
    dc = _compare(c.prompt_logprobs, want["short"], short, k, tol.margin)
    c_shape = c.new_token_ids == [] and c.finish_reason == "length" and c.num_output_tokens == 0
    ok &= dc.ok and dc.worst <= tol.logprob and c_shape
    parts.append(f"(c) max_tokens 0, 300 tokens: {dc}" + ("" if c_shape else
                 f", FINISHED WRONG ({c.finish_reason}, {c.num_output_tokens} tokens)"))
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # 1100 prompt tokens in a step budget of 1024: the long prompt, last, is split between two steps
    d = _run(engine, {"gen": (other, plain), "short": (short, asked(6)), "long": (long, asked(0))})
    dl = _compare(d["long"][0].prompt_logprobs, want["long"], long, k, tol.margin)
    ds = _compare(d["short"][0].prompt_logprobs, want["short"], short, k, tol.margin)
    wg = _greedy_wrong(hf, other, _tokens(d["gen"]), tol.margin)
    ws = _greedy_wrong(hf, short, _tokens(d["short"]), tol.margin)
    counts = [len(_tokens(d[r])) for r in ("long", "short", "gen")]
    engine.check_integrity()
    leaked = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    ok &= dl.ok and ds.ok and max(dl.worst, ds.worst) <= tol.logprob and counts == [0, 6, 16]
    ok &= wg[0] == 0 and ws[0] == 0 and leaked == 0
    parts.append(f"(d) batched with a plain request, the 600 split between steps: {dl}; {ds}; tokens {counts} "
                 f"(want [0, 6, 16]), greedy wrong {wg[0] + ws[0]}/{wg[1] + ws[1]} clear"
                 + (f", {leaked} BLOCKS LEAKED" if leaked else ""))
    return (f"prompt logprobs (top {k}), INT4 Llama via build_engine on {device} ({_graphs(engine)}) vs transformers "
            f"fp32 on the dequantized weights, tol {tol.logprob}: " + "; ".join(parts) + f" -> {_verdict(ok)}")


def check_qwen3(root: Path, device: str, dtype: torch.dtype, k: int = 3, tokens: int = 12) -> str:
    """Two Qwen3 requests batched (prompt logprobs, then greedy decode steps through the graphs) against
    transformers' Qwen3ForCausalLM in fp32."""
    tol = TOLERANCE[dtype]
    path, hf = _qwen3(root)
    lm = load_model(path, device, str(dtype).removeprefix("torch."), with_tokenizer=False, progress=False)
    engine = build_engine(lm, EngineArgs(kv_cache_memory=KV))
    g = torch.Generator().manual_seed(12)
    prompts = {"q0": torch.randint(3, VOCAB, (200,), generator=g).tolist(),
               "q1": torch.randint(3, VOCAB, (57,), generator=g).tolist()}
    params = SamplingParams(prompt_logprobs=k, max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = _run(engine, {rid: (p, params) for rid, p in prompts.items()})
    parts, ok = [], True
    for rid, prompt in prompts.items():
        diff = _compare(outs[rid][0].prompt_logprobs, _oracle(hf, prompt), prompt, k, tol.margin)
        got = _tokens(outs[rid])
        wrong, clear = _greedy_wrong(hf, prompt, got, tol.margin)
        ok &= diff.ok and diff.worst <= tol.logprob and wrong == 0 and len(got) == tokens
        parts.append(f"{len(prompt)}-token prompt: {diff}, greedy {len(got)} tokens, wrong {wrong}/{clear} clear")
    engine.check_integrity()
    return (f"qwen3 (q/k norm, head_dim 128) via build_engine on {device} ({_graphs(engine)}) vs transformers "
            f"Qwen3ForCausalLM fp32, tol {tol.logprob}: " + "; ".join(parts) + f" -> {_verdict(ok)}")


async def _ask(client, text: str, chat: list[dict], greedy: dict) -> dict:
    """Start the server (serve --reasoning-parser qwen3) in this process on a loopback port and ask it, over
    HTTP: the answers' JSON bodies by name."""
    import aiohttp

    from flotilla.server.config import ServerConfig
    from flotilla.server.serve import Server
    from flotilla.server.state import ServerState

    server = Server(ServerState(ServerConfig(port=0, reasoning_parser="qwen3"), client))
    await server.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def call(route: str, body: dict | None = None) -> dict:
                req = s.get(server.url + route) if body is None else s.post(server.url + route, json=body)
                async with req as r:
                    got = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"{route}: HTTP {r.status}: {got}")
                    return got

            model = {"model": client.model_name}
            r = {"info": await call("/tokenizer_info"), "tok": await call("/tokenize", {"prompt": text})}
            r["detok"] = await call("/detokenize", {"tokens": r["tok"]["tokens"]})
            r["echo"] = await call("/v1/completions", {**model, "prompt": text, "echo": True, "logprobs": 1,
                                                       "max_tokens": 0})
            r["chat"] = await call("/v1/chat/completions", {**model, "messages": chat, **greedy})
            r["chat_ids"] = await call("/tokenize", {"messages": chat})
            r["plain"] = await call("/v1/completions", {**model, "prompt": r["chat_ids"]["tokens"], **greedy})
            return r
    finally:
        await server.drain()


def check_server(root: Path, device: str, dtype: torch.dtype) -> str:
    """The server over the INT4 Llama and its byte tokenizer: the tokenizer endpoints, echo's prompt logprobs
    against the engine's (check_prompt_logprobs' path) and the oracle's, chat's reasoning against a plain
    completion of the same prompt."""
    from flotilla.server.engine_client import EngineClient

    tol = TOLERANCE[dtype]
    path, hf = _int4_llama(root)
    lm = load_model(path, device, str(dtype).removeprefix("torch."), progress=False)
    text = "The quick brown fox jumps over the lazy dog; caf\u00e9 \U0001F98A. " * 6
    ids = lm.tokenizer.encode(text)
    direct = build_engine(lm, EngineArgs(kv_cache_memory=KV))
    (scored,) = _run(direct, {"p": (ids, SamplingParams(max_tokens=0, prompt_logprobs=1))})["p"]
    engine_lp = [e[0] for e in scored.prompt_logprobs[1:]]
    oracle_lp = _oracle(hf, ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    del direct
    chat = [{"role": "user", "content": "2 or 3?"}]
    no_tags = {str(THINK): -100, str(END_THINK): -100}  # the random model never writes a tag itself
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logit_bias": no_tags}
    r = asyncio.run(_ask(EngineClient.from_loaded(lm, kv_cache_memory=KV), text, chat, greedy))

    parts, bad = [f"tokenize/detokenize round trip of {len(ids)} tokens, tokenizer_info"], []
    info = r["info"]
    if info.get("eos_token") != lm.tokenizer.special_token("eos_token") or info.get("chat_template") != CHAT_TEMPLATE:
        bad.append(f"tokenizer_info eos {info.get('eos_token')!r}, template {info.get('chat_template')!r}")
    if r["tok"]["tokens"] != ids or r["tok"]["count"] != len(ids) or r["detok"]["prompt"] != text:
        bad.append(f"/tokenize gave {r['tok']['count']} tokens (the tokenizer: {len(ids)}), /detokenize "
                   f"{'the text' if r['detok']['prompt'] == text else repr(r['detok']['prompt'][:40])}")
    choice = r["echo"]["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    to_engine = to_oracle = float("inf")
    if choice["text"] != text or len(lps) != len(ids) or lps[0] is not None or r["echo"]["usage"]["completion_tokens"]:
        bad.append(f"echo: {len(lps)} logprobs for {len(ids)} tokens, first {lps[0]!r}, text "
                   f"{'the prompt' if choice['text'] == text else repr(choice['text'][:40])}")
    else:
        to_engine = max(abs(a - b) for a, b in zip(lps[1:], engine_lp))
        to_oracle = max(abs(a - b) for a, b in zip(lps[1:], oracle_lp))
        if to_engine > tol.logprob / 10 or to_oracle > tol.logprob:
            bad.append("echo's logprobs off")
    parts.append(f"completions echo+logprobs max_tokens 0: vs the engine {to_engine:.1e}, vs transformers "
                 f"{to_oracle:.1e}")
    message, plain = r["chat"]["choices"][0]["message"], r["plain"]["choices"][0]["text"]
    opened = r["chat_ids"]["tokens"][-2:] == [THINK, lm.tokenizer.encode("\n")[0]]
    split = opened and message.get("reasoning") == plain and not message.get("content")
    if not split:
        bad.append(f"reasoning {message.get('reasoning')!r} and content {message.get('content')!r} for the plain "
                   f"completion's {plain!r}" + ("" if opened else ", the prompt does not end in <think>"))
    parts.append(f"chat --reasoning-parser qwen3 (the prompt ends in <think>): the {len(plain)}-char reply "
                 f"{'all reasoning' if split else 'SPLIT WRONG'}")
    return (f"server in-process on {device} (INT4 Llama, byte tokenizer): " + "; ".join(parts)
            + (f"; FAILED: {'; '.join(bad)}" if bad else "") + f" -> {_verdict(not bad)}")


CHECKS = {"prompt_logprobs": check_prompt_logprobs, "qwen3": check_qwen3, "server": check_server}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                    help="the engine's dtype (default: float16 on cuda, float32 on cpu)")
    ap.add_argument("--only", default=None, help=f"comma-separated checks of: {', '.join(CHECKS)}")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 with --device cpu)")
    args = ap.parse_args(argv)
    names = list(CHECKS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: unknown; valid: {', '.join(CHECKS)}")
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "float16"))
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, {args.device}: {name}, {str(dtype).removeprefix('torch.')}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="flotilla-gpu-features-"))
    failed = 0
    try:
        for n in names:
            start = time.perf_counter()
            try:
                line = CHECKS[n](root, args.device, dtype)
            except Exception as e:  # one check's crash is its FAIL, the others still run
                traceback.print_exc()
                line = f"{n}: raised {type(e).__name__}: {e} -> FAIL"
            failed += line.endswith("FAIL")
            print(f"({time.perf_counter() - start:.0f}s) {line}", flush=True)  # not "[": gpu_run.sh hides such lines
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
