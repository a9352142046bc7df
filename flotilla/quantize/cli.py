"""The `quantize` command: a Hugging Face directory or a .gguf file in, a GPTQ-layout checkpoint out.

    quantize SRC [-o OUT] [--bits 4|8] [--group-size G|-1] [--method gptq|rtn|awq|awq+gptq] [--sym|--asym]
             [--keep BITS:PATTERN]... [--sensitive N] [--rotate [hadamard|random]] [--rotate-scope r1|r2|r1+r2]
             [--rotate-all-channels] [--rotate-tied-head]
             [--grid output|mse|minmax] [--act-order] [--calib FILE] [--calib-samples N] [--calib-seq-len L] [--shard-size 2GB]
             [--device cpu|cuda] [--force]

Without -o the checkpoint goes beside the source: `DIR-gptq-int4/` for `DIR/`, `NAME-gptq-int4/`
for `NAME.gguf` (method and bits as asked). User mistakes, and a write that fails (a full disk,
a read-only mount), print one line (`error: ...`) and exit 2, with nothing written. Ctrl-C (SIGINT)
and SIGTERM (timeout, systemd, docker stop) remove the partial write and exit 130 and 143.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from flotilla.errors import FlotillaError

from .options import QuantizeOptions, parse_size

_DEFAULTS = QuantizeOptions()


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit 2 like every other user mistake."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see 'quantize --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="quantize", description="Quantize a model to INT4/INT8 (GPTQ, RTN, AWQ or AWQ+GPTQ) into a sharded "
                "GPTQ-layout checkpoint that flotilla, transformers and vLLM load (vLLM where the group size "
                "divides every linear's input: 64 or 32 for SmolLM2's 576).")
    p.add_argument("src", help="a Hugging Face model directory or a .gguf file")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="the checkpoint directory to create (default: beside SRC, named SRC-METHOD-intBITS)")
    p.add_argument("--bits", type=int, default=_DEFAULTS.bits, metavar="{4,8}", help="4 or 8 (default 4)")
    p.add_argument("--group-size", type=int, default=_DEFAULTS.group_size, metavar="G",
                   help="inputs per group: a multiple of 16 such as 32, 64, 128 (a size that does not divide a "
                        "linear's input leaves a partial last group), or -1 for one group per output channel "
                        "(default 128)")
    p.add_argument("--method", default=_DEFAULTS.method, metavar="{gptq,rtn,awq,awq+gptq}",
                   help="gptq, rtn, awq (activation-aware scales folded into the model, then rounding) or "
                        "awq+gptq (the scales, then GPTQ) (default gptq)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=_DEFAULTS.sym,
                     help="symmetric grid, zero point 2^(bits-1) (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grid, a zero point per group")
    p.add_argument("--grid", default="", metavar="{output,mse,minmax}",
                   help="how a group's scale is chosen: output searches the clipping range with the least error in "
                        "the linear's output on the calibration text, mse the one with the least weight error, minmax "
                        "spans the group's min to max (default output; mse for rtn, which has no calibration text)")
    p.add_argument("--desc-act", action="store_true", dest="act_order", help=argparse.SUPPRESS)  # GPTQ's name
    p.add_argument("--act-order", action="store_true", help="GPTQ visits inputs by decreasing activation "
                   "energy (recorded in g_idx)")
    p.add_argument("--fp-targets", action="store_true",
                   help="GPTQ fits each linear to the float model's output on the float model's own inputs, so it "
                        "also corrects the error the linears quantized before it left in its inputs (GPTAQ-style "
                        "asymmetric calibration); the calibration forward runs twice. On SmolLM2-135M it helped "
                        "plain GPTQ at group 128 and hurt with --act-order at group 128, --rotate and awq+gptq "
                        "(README)")
    p.add_argument("--damp-percent", type=float, default=_DEFAULTS.damp_percent, metavar="F",
                   help="GPTQ damping as a fraction of the Hessian's mean diagonal (default 0.01; raised "
                        "automatically when needed)")
    p.add_argument("--keep", action="append", default=[], metavar="BITS:PATTERN",
                   help="keep the linears whose checkpoint names (model.layers.0.self_attn.q_proj, ...) match "
                        "the regex PATTERN anywhere (e.g. 8:mlp.down_proj, 8:layers\\.0\\.) at BITS = 8, or 16 "
                        "(unquantized); repeatable")
    p.add_argument("--sensitive", type=int, default=0, metavar="N",
                   help="also keep at 8 bits the N linears whose INT4 error, measured on the calibration text, "
                        "is largest (default 0)")
    p.add_argument("--lm-head-bits", type=int, default=None, metavar="{4,8}",
                   help="quantize the lm_head too, round to nearest (default: fp16, as GPTQ tools keep it). 8 is "
                        "within noise of fp16 and makes a GPU decode step faster: the head is the largest matrix "
                        "a step reads (llama-3-8b: 1 GB in fp16). Written as GPTQModel writes it (lm_head: true)")
    p.add_argument("--rotate", nargs="?", const="hadamard", default="", metavar="{hadamard,random}",
                   help="rotate the model by orthogonal matrices folded into its weights before quantizing "
                        "(QuaRot-style, weights only: the checkpoint needs nothing at load time): norm weights are "
                        "folded into the linears, the residual stream is rotated by a hidden x hidden matrix and "
                        "each head's values by a head_dim one. hadamard (the default when the flag is bare): a "
                        "randomized Hadamard matrix where the order is 2^k times a Paley order (572 = 571 + 1, "
                        "576 = 72 x 8, 64, 2048, 4096, ...), else a seeded random orthogonal one (QR of a Gaussian); random: "
                        "always the latter. A tied lm_head becomes an untied fp16 one (see --rotate-tied-head)")
    p.add_argument("--rotate-scope", default=_DEFAULTS.rotate_scope, metavar="{r1,r2,r1+r2}",
                   help="r1: the residual stream only; r2: each attention head's values only (keeps the norms and a "
                        "tied lm_head); r1+r2: both (default r1+r2)")
    p.add_argument("--rotate-all-channels", action="store_true",
                   help="R1 rotates every residual channel; by default the few that the model's norms suppress in "
                        "many layers (where its massive activations are) are left out, their norm weights kept")
    p.add_argument("--rotate-tied-head", action="store_true",
                   help="keep a tied lm_head tied under R1: the checkpoint stores the rotated embedding once and "
                        "the final norm's weight as a hidden x hidden matrix (model.norm_matrix.weight), instead of "
                        "an untied fp16 lm_head (SmolLM2-135M: 4.2 instead of 8.5 bits per weight). Such a "
                        "checkpoint runs in flotilla only: other tools (transformers, vLLM) ignore the matrix and "
                        "compute wrong logits; without the flag it is a plain Llama GPTQ checkpoint")
    p.add_argument("--calib", type=Path, default=None, metavar="FILE",
                   help="calibration text: a text file, or JSONL with a \"text\" field "
                        "(default: text sampled from the model itself)")
    p.add_argument("--calib-samples", type=int, default=_DEFAULTS.calib_samples, metavar="N",
                   help=f"calibration sequences (default {_DEFAULTS.calib_samples})")
    p.add_argument("--calib-seq-len", type=int, default=_DEFAULTS.calib_seq_len, metavar="L",
                   help=f"tokens per calibration sequence (default {_DEFAULTS.calib_seq_len})")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, metavar="N",
                   help="seed of calibration sampling (default 0)")
    p.add_argument("--shard-size", default="2GB", metavar="SIZE",
                   help="largest shard, cut on layer boundaries (default 2GB)")
    p.add_argument("--device", default=_DEFAULTS.device, metavar="{cpu,cuda}", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                   help="CPU threads (default: one per core); on a machine busy with other work (a server "
                        "decoding beside it) fewer can be much faster")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it exists: only an empty directory or a model checkpoint, never one holding "
                        "the source")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def options_from_args(args: argparse.Namespace) -> QuantizeOptions:
    return QuantizeOptions(bits=args.bits, group_size=args.group_size, method=args.method, sym=args.sym,
                           act_order=args.act_order, grid=args.grid, damp_percent=args.damp_percent, calib_file=args.calib,
                           calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, seed=args.seed,
                           shard_size=parse_size(args.shard_size), device=args.device, force=args.force,
                           keep=tuple(QuantizeOptions.parse_keep(k) for k in args.keep), sensitive=args.sensitive,
                           lm_head_bits=args.lm_head_bits, rotate=args.rotate, rotate_scope=args.rotate_scope,
                           rotate_all=args.rotate_all_channels, rotate_tied_head=args.rotate_tied_head,
                           fp_targets=args.fp_targets)


def ignored_options(args: argparse.Namespace, options: QuantizeOptions) -> list[str]:
    """The options given that this run does not use, each said (the run goes on without them)."""
    notes = []
    if not options.needs_calibration:
        given = [name for name, value, default in (("--calib", args.calib, None),
                                                   ("--calib-samples", args.calib_samples, _DEFAULTS.calib_samples),
                                                   ("--calib-seq-len", args.calib_seq_len, _DEFAULTS.calib_seq_len))
                 if value != default]
        if given:
            notes.append(f"{', '.join(given)} ignored: --method {options.method} reads no calibration text (it does "
                         "with --sensitive N)")
    if options.method not in ("gptq", "awq+gptq") and args.damp_percent != _DEFAULTS.damp_percent:
        notes.append(f"--damp-percent ignored: it damps GPTQ's Hessian, and --method {options.method} has none")
    return notes


def default_out(src: Path, options: QuantizeOptions) -> Path:
    """Where a checkpoint goes without -o: beside the source, `model/` -> `model-gptq-int4/`,
    `model.gguf` -> `model-gptq-int4/`. The path is made absolute first, `.` and `..` folded, so
    `quantize .` names the directory it is run in; symlinks are kept (a GGUF linked from a hub cache
    keeps its name, not its blob's hash)."""
    src = Path(os.path.abspath(src.expanduser()))
    name = src.stem if src.suffix.lower() == ".gguf" else src.name
    return src.parent / f"{name}-{options.method}-int{options.bits}"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that the checkpoint
    writer unwinds and removes its temporary directory. A BaseException: no `except Exception` takes it."""


@contextlib.contextmanager
def _sigterm_raises():
    """Within: SIGTERM raises Terminated (once: a second one cannot cut the cleanup short). Outside the
    main thread, where no handler can be set: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)  # None: set from C


def _announce_default(out: Path) -> None:
    print(f"writing the checkpoint to {out} (no -o given)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        with _sigterm_raises():
            from .pipeline import quantize_model

            if args.threads is not None:
                if args.threads < 1:
                    raise FlotillaError(f"--threads must be at least 1, got {args.threads}")
                import torch

                torch.set_num_threads(args.threads)
            options = options_from_args(args)
            for line in ignored_options(args, options):
                print(f"note: {line}", file=sys.stderr)
            out = args.out if args.out is not None else default_out(Path(args.src), options)
            # said once SRC and OUT are checked: a missing SRC gets its error alone
            report = quantize_model(args.src, out, options, progress=not args.quiet,
                                    on_checked=_announce_default if args.out is None else None)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated (SIGTERM); nothing was written", file=sys.stderr)
        return 143
    print("\n".join(report.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
