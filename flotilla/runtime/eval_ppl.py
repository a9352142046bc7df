"""`runtime eval-ppl MODEL --text FILE [--ctx N --stride S]`: perplexity over a text.

Sliding window (as in Hugging Face's perplexity guide): windows of `ctx` tokens start every
`stride` tokens, and each window scores only the tokens that no earlier window scored, each
with at least ctx - stride tokens of context. With stride < ctx every token after the first is
scored exactly once; with stride == ctx the first token of each window has no context and is not
scored. ppl = exp(mean negative log-likelihood over the scored tokens).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from flotilla.errors import FlotillaError

# torch and the model are imported inside the functions: `runtime --help` stays instant.


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    windows: int


def perplexity(model, ids: list[int], ctx: int, stride: int) -> Perplexity:
    """Perplexity of a whole-model CausalLM over the token ids `ids`."""
    import torch

    with torch.inference_mode():
        return _perplexity(model, ids, ctx, stride)


def _perplexity(model, ids: list[int], ctx: int, stride: int) -> Perplexity:
    import torch
    import torch.nn.functional as F

    from flotilla.models.attention import DenseCausalAttention

    if len(ids) < 2:
        raise FlotillaError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    if not 0 < stride <= ctx:
        raise FlotillaError(f"--stride {stride} must be in [1, --ctx {ctx}]")
    device = next(model.parameters()).device
    tokens = torch.tensor(ids, device=device)
    total_nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        window = tokens[begin:end]  # [W]
        hidden = model(window, torch.arange(end - begin, device=device), DenseCausalAttention(1, end - begin))
        first = max(prev_end, begin + 1) - begin  # first position (in the window) scored here
        logits = model.compute_logits(hidden[first - 1:-1])  # predicts window[first:]
        total_nll += float(F.cross_entropy(logits, window[first:], reduction="sum"))
        scored += end - begin - first
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    nll = total_nll / scored
    return Perplexity(math.exp(nll), nll, scored, windows)


def add_args(p: argparse.ArgumentParser) -> None:
    from .cli import add_model_args

    add_model_args(p)
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=1024, help="window length in tokens (default 1024, capped at the "
                                                         "model's context)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default ctx/2)")


def run(args: argparse.Namespace) -> int:
    from .host_memory import lean_cpu_load
    from .loader import load_model, parse_device

    if args.text.is_dir():
        raise FlotillaError(f"--text {args.text}: a directory; give a text file in it")
    if not args.text.is_file():
        raise FlotillaError(f"--text {args.text}: no such file")
    try:
        text = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FlotillaError(f"--text {args.text}: not UTF-8 text ({e})") from None
    if args.ctx < 2:
        raise FlotillaError(f"--ctx {args.ctx} must be at least 2")
    if args.stride is not None and not 1 <= args.stride <= args.ctx:  # said before the model loads
        raise FlotillaError(f"--stride {args.stride} must be in [1, --ctx {args.ctx}]")
    with lean_cpu_load(parse_device(args.device)):  # the `runtime eval-ppl` process
        lm = load_model(args.model, args.device, args.dtype)
    ctx = min(args.ctx, lm.config.max_model_len)
    if ctx < args.ctx:
        print(f"note: --ctx {args.ctx} is past the model's context; scoring windows of {ctx}", file=sys.stderr)
    stride = min(args.stride, ctx) if args.stride is not None else max(1, ctx // 2)
    ids = lm.tokenizer.encode(text)
    result = perplexity(lm.model, ids, ctx, stride)
    print(f"perplexity {result.ppl:.4f}  (nll {result.nll:.4f} nats/token over {result.tokens} tokens, "
          f"{result.windows} windows of ctx {ctx}, stride {stride}; {args.text})")
    return 0
