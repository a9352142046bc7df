"""The `runtime` command: generate, chat (and, registered by the server package, serve).

User mistakes (bad paths, bad files, bad flags) print one line and exit 2; no traceback.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

from flotilla.errors import FlotillaError

from . import eval_ppl
from .sampling import SamplingParams

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a flotilla checkpoint, a Hugging Face directory or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", help="activation dtype: auto, float32, float16, bfloat16 "
                                                   "(default: float32 on CPU, float16 on GPU)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


# ------------------------------------------------------------------------------------ generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    add_sampling_args(p, max_tokens=128)
    p.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")


def _generate(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .simple import generate_tokens

    params = sampling_from_args(args)
    lm = load_model(args.model, args.device, args.dtype)
    tok = lm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    detok = tok.detokenizer(ids)
    start, n = time.perf_counter(), 0
    first = None
    for token_id in generate_tokens(lm.model, ids, params, tok.eos_token_ids):
        n += 1
        first = first or time.perf_counter()
        if token_id in tok.eos_token_ids:
            break
        sys.stdout.write(detok.add(token_id))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if args.stats and n:
        elapsed = time.perf_counter() - start
        decode = (n - 1) / (time.perf_counter() - first) if n > 1 else float("nan")
        print(f"[{n} tokens in {elapsed:.2f}s, decode {decode:.1f} tok/s]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------- chat

def _chat_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--system", default=None, help="a system prompt")
    add_sampling_args(p, max_tokens=512)


def _chat(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .simple import generate_tokens

    params = sampling_from_args(args)
    lm = load_model(args.model, args.device, args.dtype)
    tok = lm.tokenizer
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("flotilla chat — empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.apply_chat_template(messages)
        detok, reply = tok.detokenizer(ids), []
        for token_id in generate_tokens(lm.model, ids, params, tok.eos_token_ids):
            if token_id in tok.eos_token_ids:
                break
            delta = detok.add(token_id)
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        tail = detok.flush()
        reply.append(tail)
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})


COMMANDS: list[Command] = [
    ("generate", "generate text from a prompt, streamed to stdout", _generate_args, _generate),
    ("chat", "an interactive chat in the terminal through the model's chat template", _chat_args, _chat),
    ("eval-ppl", "perplexity of a model over a text file (sliding window)", eval_ppl.add_args, eval_ppl.run),
]


def build_parser(commands: list[Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runtime",
        description="flotilla runtime: run quantized LLMs on a CPU, a GPU or a pipeline of machines.",
        epilog="Run 'runtime COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, add_args, _ in commands:
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def run(argv: list[str] | None, commands: list[Command]) -> int:
    args = build_parser(commands).parse_args(argv)
    handler = {name: fn for name, _, _, fn in commands}[args.command]
    try:
        return handler(args)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def main(argv: list[str] | None = None) -> int:
    return run(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
