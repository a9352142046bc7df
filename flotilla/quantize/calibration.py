"""Calibration token sequences: read from a text/JSONL file, or sampled from the model itself.

Both give a LongTensor [samples, seq_len]: equal lengths, so every batch runs through a layer as
one dense causal-attention call.

Self-generated calibration needs no dataset: each sequence starts from BOS and one uniformly
random token, then the model samples (temperature 1, top-k 256, top-p 0.95, seeded, end-of-sequence banned
so every sequence reaches seq_len). The whole model is loaded for this, in bf16 on CPU (fp16 on
CUDA) to halve its memory, and freed before quantization begins.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from flotilla.errors import FlotillaError
from flotilla.models.attention import LockstepKVCache
from flotilla.models.weights import load_stage
from flotilla.progress import progress_bar

TOP_P = 0.95
TOP_K = 256
GENERATION_BATCH = 128  # sequences sampled together (the default --calib-samples: one batch)
KV_BUDGET = 4 << 30  # bytes of KV cache a batch may hold: 128 x 2048 tokens of an 8B model would take 32 GiB


def read_texts(path: Path) -> list[str]:
    """The documents of a calibration file: JSONL (one object with a "text" field a line) when
    the name ends in .jsonl/.json, else the whole file as one text."""
    if not path.is_file():
        raise FlotillaError(f"--calib {path}: no such file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FlotillaError(f"--calib {path}: not UTF-8 text ({e})") from None
    if path.suffix.lower() not in (".jsonl", ".json"):
        texts = [content] if content.strip() else []
    else:
        texts = []
        for n, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise FlotillaError(f"--calib {path}, line {n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise FlotillaError(f"--calib {path}, line {n}: expected an object with a string \"text\" field")
            if record["text"].strip():
                texts.append(record["text"])
    if not texts:
        raise FlotillaError(f"--calib {path}: the calibration file holds no text")
    return texts


def tokens_from_file(path: Path, tokenizer, vocab_size: int, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Tokenize the documents, join them (separated by EOS), cut into windows of seq_len and pick
    `samples` of them at random (seeded). A text shorter than seq_len gives one shorter window."""
    if tokenizer is None:
        raise FlotillaError(f"--calib {path}: the source model has no tokenizer to read text with")
    sep = list(tokenizer.eos_token_ids[:1])
    ids: list[int] = []
    for text in read_texts(path):
        ids.extend(tokenizer.encode(text))
        ids.extend(sep)
    ids = ids[:-1] if sep else ids
    if len(ids) < 2:
        raise FlotillaError(f"--calib {path}: too little text ({len(ids)} token); need at least 2")
    if max(ids) >= vocab_size:
        raise FlotillaError(f"--calib {path}: the tokenizer produced id {max(ids)} outside the model's vocabulary "
                            f"of {vocab_size}")
    length = min(seq_len, len(ids))
    windows = torch.tensor(ids[: len(ids) // length * length]).view(-1, length)  # [W, length]
    if windows.shape[0] > samples:
        pick = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))[:samples]
        windows = windows[pick.sort().values]
    elif windows.numel() < samples * seq_len:  # GPTQModel warns of too few samples too
        print(f"note: --calib {path} gives {windows.shape[0]} x {length} = {windows.numel():,} tokens of the "
              f"{samples} x {seq_len} = {samples * seq_len:,} asked for (--calib-samples x --calib-seq-len); "
              "a longer text calibrates better", file=sys.stderr)
    return windows


# how to skip sampling the calibration text (--sensitive needs it with rtn too)
SKIP_HINT = "--calib FILE skips this; so does --method rtn without --sensitive"


@torch.inference_mode()
def generate_tokens(source, samples: int, seq_len: int, seed: int, device: torch.device,
                    progress: bool = True) -> torch.Tensor:
    """Sample `samples` sequences of `seq_len` tokens from the model of `source`."""
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    model = load_stage(source, device=device, dtype=dtype)
    source.release()  # the model holds its own copy; unmap the source files
    prompt_len = min(seq_len, 1 if source.config.bos_token_id is None else 2)
    total = samples * (seq_len - prompt_len)
    if progress:
        print(f"calibration: sampling {samples} x {seq_len} tokens from the model itself "
              f"({SKIP_HINT})", file=sys.stderr)
    with progress_bar(total=total, desc="calibration text", unit="tok", disable=not progress, leave=False) as bar:
        tokens = sample_sequences(model, samples, seq_len, seed, on_step=lambda n: _show_expected(bar, n, total))
    del model
    return tokens


@torch.inference_mode()
def sample_sequences(model, samples: int, seq_len: int, seed: int, batch: int | None = None,
                     sample: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
                     on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """`samples` sequences from BOS and a random token, `batch` of them at a time (default:
    generation_batch), each step's tokens drawn by `sample` (default sample_top_p);
    `on_step(tokens)` after each step."""
    cfg, weight = model.config, next(model.parameters())
    device, dtype = weight.device, weight.dtype
    sample = sample or sample_top_p
    batch = batch or generation_batch(cfg, len(model.stage.layers), seq_len, dtype)
    model.build_rope(seq_len)
    gen = torch.Generator(device=device).manual_seed(seed)
    banned = torch.tensor([i for i in cfg.eos_token_ids if i < cfg.vocab_size], dtype=torch.long, device=device)
    out = []
    for start in range(0, samples, batch):
        B = min(batch, samples - start)
        first = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen, device=device)
        prompt = first if cfg.bos_token_id is None else torch.cat(
            [torch.full((B, 1), cfg.bos_token_id, device=device), first], dim=1)
        seqs = torch.empty(B, seq_len, dtype=torch.long, device=device)
        n = min(prompt.shape[1], seq_len)
        seqs[:, :n] = prompt[:, :n]
        cache = LockstepKVCache(model.stage.layers, B, seq_len, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        step = seqs[:, :n]  # [B, n] tokens fed this step
        while n < seq_len:
            positions = torch.arange(cache.length, cache.length + step.shape[1], device=device).repeat(B)
            hidden = model(step.reshape(-1), positions, cache)  # [B * n, hidden]
            cache.advance(step.shape[1])
            last = hidden.view(B, step.shape[1], -1)[:, -1]  # [B, hidden]
            logits = model.compute_logits(last)  # fp32 [B, vocab]
            logits[:, banned] = float("-inf")
            seqs[:, n] = sample(logits, gen)
            step = seqs[:, n:n + 1]
            n += 1
            if on_step is not None:
                on_step(B)
        out.append(seqs.cpu())
    return torch.cat(out)


def generation_batch(cfg, num_layers: int, seq_len: int, dtype: torch.dtype) -> int:
    """Sequences sampled together: GENERATION_BATCH, fewer where their lockstep KV cache of
    `seq_len` tokens each would pass KV_BUDGET (long --calib-seq-len on a large model)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_seq = 2 * num_layers * cfg.num_key_value_heads * cfg.head_dim * seq_len * elem  # keys and values
    return max(1, min(GENERATION_BATCH, KV_BUDGET // per_seq))


def _show_expected(bar: tqdm, tokens: int, total: int) -> None:
    """Advance the bar; beside it, once the rate is steady, the expected time of the whole
    generation and how to skip it."""
    bar.update(tokens)
    if bar.disable or bar.n * 16 < total:
        return
    seconds = total * bar.format_dict["elapsed"] / max(bar.n, 1)
    bar.set_postfix_str(f"about {seconds:.0f} s in all; {SKIP_HINT}", refresh=False)


def sample_top_p(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row: the TOP_K likeliest tokens, renormalized, cut to the top-p nucleus (the
    tokens, by decreasing probability, whose preceding mass is at most TOP_P), then sampled.
    (topk of a few hundred costs a fraction of sorting the whole vocabulary each step.)"""
    k = min(TOP_K, logits.shape[-1])
    top_logits, idx = logits.topk(k, dim=-1)  # [B, k], descending
    sorted_p = torch.softmax(top_logits, dim=-1)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > TOP_P, 0.0)
    choice = torch.multinomial(sorted_p, 1, generator=gen)  # [B, 1] index into the sorted order
    return idx.gather(-1, choice).squeeze(-1)
