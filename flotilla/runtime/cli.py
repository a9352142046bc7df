"""The `runtime` command: generate, chat (and, registered by the server package, serve).

User mistakes (bad paths, bad files, bad flags) print one line and exit 2; no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from flotilla.errors import FlotillaError
from flotilla.progress import say_line

from . import bench, eval_ppl
from .pipeline import cli as pipeline_cli
from .sampling import SamplingParams

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


THREADS_HELP = ("CPU threads for the compute (default: one per core). On a machine busy with other work, fewer "
                "can be much faster: the threads wait for each other at every op, so one that loses its core "
                "stalls them all (2 cores and one other busy process: 2 threads 46 tok/s, 1 thread 90)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N", help=THREADS_HELP)


def apply_threads(threads: int | None) -> None:
    """--threads: torch's (and so the CPU kernels') thread count for this process."""
    if threads is None:
        return
    if threads < 1:
        raise FlotillaError(f"--threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def check_kernel_env() -> None:
    """FLOTILLA_KERNEL, FLOTILLA_CPU_ISA and the GEMV's switches, checked before anything loads (by the registry's
    and the CPU build's own rules): a typo in one is an error here, not a traceback later nor a silent fallback to
    a slower kernel."""
    import os

    from flotilla.kernels.cpu import build
    from flotilla.kernels.registry import ENV_KERNEL, kernel_names

    forced = os.environ.get(ENV_KERNEL, "").strip()
    if forced and forced not in (names := kernel_names()):
        raise FlotillaError(f"{ENV_KERNEL}={forced!r} is not a kernel; valid: {', '.join(names)} "
                            f"(unset it for the fastest)")
    try:
        build.best_isa()
    except ValueError as e:
        raise FlotillaError(f"{e} (unset it for the widest this CPU runs)") from None
    from flotilla import envs
    from flotilla.kernels.cuda.gemv import GROUP32_ENV, OFFSETS_ENV

    for name, also_on in ((OFFSETS_ENV, ()), (GROUP32_ENV, ("cores",))):  # the GEMV's switches
        try:
            envs.switch(name, False, also_on)
        except ValueError as e:
            raise FlotillaError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a flotilla checkpoint, a Hugging Face directory or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    add_threads_arg(p)
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", help="activation dtype: auto, float32, float16, bfloat16 "
                                                   "(default: float32 on CPU; on a GPU float16, bfloat16 for Gemma 2 / 3)")


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="render chats with this Jinja template instead of the model's: a file (.jinja, or a "
                        "chat_template.json) or the template itself, as vLLM's --chat-template")


def chat_template_arg(args: argparse.Namespace) -> str | None:
    """--chat-template's text, read and checked (before the model loads); None when not given."""
    from flotilla.models.tokenizer import read_chat_template

    value = getattr(args, "chat_template", None)
    return read_chat_template(value) if value else None


def use_chat_template(tokenizer, template: str | None) -> None:
    if template is not None and tokenizer is not None:
        tokenizer.set_chat_template(template)


CHAT_TEMPERATURE = 0.7  # the chat's default, as the browser chat page's (greedy replies of a small model loop)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature:g})")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="keep the likeliest tokens whose probabilities add up to P, in (0, 1] (default 1: all)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (default 0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than P x the likeliest's probability, in [0, 1] (default 0: none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens already in the prompt or reply by R > 0 (> 1 discourages them; "
                        "default 1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract P in [-2, 2] from tokens already in the reply, once (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract F in [-2, 2] times a token's count in the reply (default 0)")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None,
                   help="a seed: the same seed, prompt and settings give the same reply (default: random)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    if args.max_tokens < 1:  # (the API's max_tokens 0 scores a prompt with echo; these commands generate)
        raise FlotillaError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              stop=tuple(args.stop), seed=args.seed)
    except FlotillaError as e:  # SamplingParams names its fields (the API's); here the user typed flags
        field, _, rest = str(e).partition(" ")
        raise FlotillaError(f"--{field.replace('_', '-')} {rest}") from None


def load_with_progress(args: argparse.Namespace, say: Callable[[str], None]):
    """Load the model of `args` (the --tp ranks too), saying through `say` what loads and, when
    done, how long it took."""
    from .default_model import DEFAULT_MODEL_NAME
    from .host_memory import lean_cpu_load
    from .loader import parse_device
    from .tp import load_model_parallel

    start = time.perf_counter()
    say(f"loading {args.model or DEFAULT_MODEL_NAME}…")
    with lean_cpu_load(parse_device(args.device)):  # a CLI process: its malloc settings are ours to set
        lm = load_model_parallel(args.model, args.device, args.dtype, tp=args.tp)
    dtype = str(lm.dtype).removeprefix("torch.")
    quant = getattr(lm.config.quant, "describe", None)
    say(f"loaded {lm.path.name} in {time.perf_counter() - start:.1f} s ({lm.device}, {dtype}"
        f"{f', {quant()}' if quant is not None else ''}{f', {args.tp} ranks' if args.tp > 1 else ''}); "
        "building the engine")
    return lm


def _say_on_terminal(line: str) -> None:
    """Progress for a person at a terminal; a pipe or a log keeps only the KV cache line and errors."""
    if sys.stderr.isatty():
        print(line, file=sys.stderr, flush=True)


def _engine(args: argparse.Namespace):
    """Load the model and build the engine (over a pipeline of stages with --pp/--hosts/--devices, where
    the command takes them); progress (at a terminal) and the KV cache report go to stderr."""
    from .engine_args import EngineArgs, build_engine

    engine_args = EngineArgs.from_args(args)  # checks the engine flags before the model loads
    if getattr(args, "chat_template", None) and getattr(args, "chat", True) is False:
        raise FlotillaError("--chat-template renders a chat: add --chat (the prompt as a user turn)")
    template = chat_template_arg(args)
    report = say_line
    if pipeline_cli.is_pipeline(args):
        # local workers' own log: errors only (their notices would land in the middle of a streamed reply)
        args.worker_log_level = "error"
        engine = pipeline_cli.pipeline_engine_from_args(args, report)
    else:
        engine = build_engine(load_with_progress(args, _say_on_terminal), engine_args, report=report)
    use_chat_template(engine.tokenizer, template)
    return engine


def _stream(engine, request_id: str, ids: list[int], params: SamplingParams, out=sys.stdout, stop=None):
    """Run one request on the engine, writing text deltas as they come; returns (text, tokens,
    seconds to the first token, seconds for the rest, whether `stop` ended it). `stop()`, asked between
    engine steps: true aborts the request there (its KV blocks freed) with what was written so far."""
    engine.add_request(request_id, ids, params)
    start, first, n, parts, stopped = time.perf_counter(), None, 0, [], False
    while engine.has_unfinished():
        if stop is not None and stop():
            engine.abort(request_id)
            stopped = True
            break
        for o in engine.step():
            n += len(o.new_token_ids)
            if first is None and n:
                first = time.perf_counter()
            parts.append(o.text)
            out.write(o.text)
            out.flush()
    end = time.perf_counter()
    return "".join(parts), n, (first or end) - start, end - (first or end), stopped


@contextlib.contextmanager
def _interrupt_flag():
    """Within: Ctrl-C (SIGINT) sets the flag (a one-item list) instead of raising, so that a reply stops
    between engine steps; a second Ctrl-C raises as usual. Outside the main thread: no handler."""
    flag = [False]
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_sigint(signum, frame):
        if flag[0]:
            raise KeyboardInterrupt
        flag[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)  # None: set from C


# ------------------------------------------------------------------------------------ generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    from .engine_args import EngineArgs
    from .tp import add_tp_args

    add_model_args(p)
    add_tp_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="the prompt text (or --file, or the prompt piped on stdin)")
    src.add_argument("--file", "-f", metavar="FILE", help="read the prompt from FILE ('-': stdin), as llama.cpp's -f")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    add_chat_template_arg(p)
    add_sampling_args(p, max_tokens=128)
    EngineArgs.add_args(p)
    p.set_defaults(max_num_seqs=1)  # one request: the KV cache needs room for one context only
    p.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")


def _prompt_text(args: argparse.Namespace) -> str:
    """generate's prompt: --prompt, --file (- for stdin), or stdin when it is not a terminal; checked before
    the model loads."""
    ask = "give the prompt: --prompt TEXT, --file FILE, or pipe it on stdin"
    stdin = sys.stdin
    if args.prompt is not None:
        text = args.prompt
    elif args.file not in (None, "-") or (stdin is not None and not stdin.isatty()):
        name = args.file if args.file not in (None, "-") else None
        where = f"--file {name}" if name else "stdin"
        try:
            text = Path(name).read_text(encoding="utf-8") if name else stdin.read()
        except OSError as e:
            raise FlotillaError(f"{where}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise FlotillaError(f"{where}: not UTF-8 text") from None
        text = text.removesuffix("\n").removesuffix("\r")  # a file's or echo's last line end: not the prompt's
        if not text:
            raise FlotillaError(f"{where} gave an empty prompt; {ask}")
    else:
        raise FlotillaError(ask)
    if not text:
        raise FlotillaError("the prompt is empty: give at least one character of text")
    return text


def _generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    prompt = _prompt_text(args)
    engine = _engine(args)
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else tok.encode(prompt)
    _, n, ttft, rest, _ = _stream(engine, "generate", ids, params)
    sys.stdout.write("\n")
    context = engine.config.context_len
    if n < params.max_tokens and len(ids) + n >= context:  # not EOS nor --max-tokens: the context is full
        print(f"[stopped after {n} tokens: the prompt's {len(ids)} and the reply filled the {context}-token "
              f"context (--max-model-len, --kv-cache-memory)]", file=sys.stderr)
    if args.stats and n:
        decode = (n - 1) / rest if n > 1 and rest > 0 else float("nan")
        spec = ""
        if engine.spec is not None:
            st = engine.stats()
            spec = (f", {st.spec_acceptance_rate:.0%} of {st.spec_draft_tokens_total} drafts accepted, "
                    f"{st.spec_accepted_tokens_per_step:.2f} a verify step")
        print(f"[{n} tokens, first after {ttft:.2f}s, decode {decode:.1f} tok/s{spec}]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------- chat

def _chat_args(p: argparse.ArgumentParser) -> None:
    from .engine_args import EngineArgs
    from .tp import add_tp_args

    add_model_args(p)
    add_tp_args(p)
    p.add_argument("--system", default=None, help="a system prompt")
    add_chat_template_arg(p)
    add_sampling_args(p, max_tokens=512, temperature=CHAT_TEMPERATURE)
    EngineArgs.add_args(p)
    p.set_defaults(max_num_seqs=1)
    pipeline_cli.add_pipeline_args(p)  # as `runtime serve`'s: the chat's model over a pipeline of stages
    p.epilog = "In the chat: " + CHAT_KEYS + "."


def _chat(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    engine = _engine(args)
    try:
        return _chat_loop(engine, args, params)
    finally:
        close = getattr(engine, "close", None)  # a pipeline: its connections and local workers
        if close is not None:
            close()


def _chat_loop(engine, args: argparse.Namespace, params: SamplingParams) -> int:
    tok = engine.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (input() then edits the line, keeps a history, and takes any length)
        except ImportError:
            pass
        print("flotilla chat — " + CHAT_KEYS, file=sys.stderr)
    for turn in itertools.count():
        line = _read_message(interactive)
        if line is None:
            return 0
        if not line.strip():
            continue
        command = line.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command == "/help":
            print(CHAT_KEYS, file=sys.stderr)
            continue
        if command == "/reset":
            messages = list(system)
            print("[a new conversation]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        ids, dropped = _fit_context(tok, messages, len(system), engine.config.context_len, params.max_tokens)
        if ids is None:
            # the count is the system prompt and this message through the template (a template may add a default
            # system prompt of its own to a message alone, so the two are not told apart)
            size = dropped
            what = (f"that message with the system prompt ({size} tokens)" if system
                    else f"that message alone ({size} tokens)")
            messages.pop()
            print(f"error: {what} leaves no room for a reply in the context of {engine.config.context_len} "
                  "tokens; send a shorter one", file=sys.stderr)
            continue
        if dropped:
            del messages[len(system):len(system) + dropped]
            print(f"[the {dropped} oldest messages were dropped to fit the context of {engine.config.context_len} "
                  "tokens]", file=sys.stderr)
        with _interrupt_flag() as interrupted:  # Ctrl-C stops this reply; what was shown stays in the chat
            reply, *_, stopped = _stream(engine, f"chat-{turn}", ids, params, stop=lambda: interrupted[0])
        if stopped:  # (a Ctrl-C after the reply's last step stops nothing)
            print("\n[stopped]", end="", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0


CHAT_KEYS = ("Ctrl-C stops a reply (at the prompt: quits), Ctrl-D or /quit quits, /reset starts over, a line ending "
             "in \\ goes on on the next line")


def _read_message(interactive: bool) -> str | None:
    """The next message, or None at the end of the input. At a terminal: through input() (line editing, history,
    no 4096-byte line limit of the terminal's own line mode), a line ending in a backslash continuing on the next
    (as llama.cpp's interactive mode); piped: one line."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    parts: list[str] = []
    while True:
        prompt = "> " if not parts else "… "
        try:
            if sys.stdout.isatty():
                line = input(prompt)
            else:  # the replies go elsewhere: the prompt to the terminal
                print(prompt, end="", flush=True, file=sys.stderr)
                line = input()
        except EOFError:
            print(file=sys.stderr)  # the shell's prompt on a line of its own
            return "\n".join(parts) if parts else None  # (what was typed before a continued line's Ctrl-D goes)
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        return "\n".join(parts + [line])


def _fit_context(tok, messages: list[dict], keep: int, context_len: int, max_tokens: int):
    """The chat's prompt ids with the oldest turns after the first `keep` messages (the system prompt) dropped
    until the prompt leaves room for a reply (max_tokens, at most half the context): (ids, messages dropped),
    or (None, the tokens of the kept messages and the last one) where even those alone do not fit."""
    room = min(max_tokens, context_len // 2)
    dropped = 0
    while True:
        ids = tok.apply_chat_template(messages[:keep] + messages[keep + dropped:])
        if len(ids) + room <= context_len:
            return ids, dropped
        if keep + dropped >= len(messages) - 1:
            return None, len(ids)
        dropped += 1
        if messages[keep + dropped - 1]["role"] == "user" and keep + dropped < len(messages) - 1:
            dropped += 1  # a user turn goes with its reply


COMMANDS: list[Command] = [
    ("generate", "generate text from a prompt, streamed to stdout", _generate_args, _generate),
    ("chat", "an interactive chat in the terminal through the model's chat template", _chat_args, _chat),
    ("eval-ppl", "perplexity of a model over a text file (sliding window)", eval_ppl.add_args, eval_ppl.run),
    ("bench", "decode tok/s of the engine at several batch sizes, on a random-weight model of a named shape "
              "(--random llama-3-8b) or a model path", bench.add_args, bench.run),
    ("worker", "serve one pipeline stage to a head (`runtime serve --pp N --hosts ...`) over authenticated TCP",
     pipeline_cli.add_worker_args, pipeline_cli.run_worker),
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
    parser.commands = sub.choices  # each command's own parser, for parse()'s errors
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args, but an unknown option is reported with its command's usage (argparse names the
    top-level one), and `runtime quantize` is pointed at the `quantize` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["quantize"]:
        parser.error("quantize is a command of its own, not a runtime COMMAND: run "
                     f"'{shlex.join(['quantize', *(argv[1:] or ['--help'])])}'")
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(f"unrecognized arguments: {shlex.join(extra)} (see 'runtime "
                                            f"{args.command} --help'){_elsewhere(parser, extra)}")
    return args


def _elsewhere(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """'; --pp is an option of runtime chat, serve' for the unknown options that other commands take."""
    notes = []
    for option in dict.fromkeys(e.split("=", 1)[0] for e in extra if e.startswith("-")):
        owners = [name for name, sub in parser.commands.items() if option in sub._option_string_actions]
        if owners:
            notes.append(f"{option} is an option of {', '.join(f'runtime {o}' for o in owners)}")
    return "; " + "; ".join(notes) if notes else ""


def run(argv: list[str] | None, commands: list[Command]) -> int:
    args = parse(build_parser(commands), argv)
    handler = {name: fn for name, _, _, fn in commands}[args.command]
    from flotilla.kernels.registry import KernelChoiceError

    try:
        check_kernel_env()
        apply_threads(getattr(args, "threads", None))
        return handler(args)
    except (FlotillaError, KernelChoiceError) as e:
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
