"""What one `quantize` run is asked to do, validated once at the door."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.errors import FlotillaError

METHODS = ("gptq", "rtn", "awq", "awq+gptq")
KEEP_BITS = (8, 16)  # --keep BITS:PATTERN: 8-bit, or 16 (left in fp16, unquantized)
BITS = (4, 8)
GROUP_MULTIPLE = 16  # a group size is -1 (per channel) or a positive multiple of this
DEVICES = ("cpu", "cuda")
GRIDS = ("mse", "minmax", "output")
ROTATIONS = ("", "hadamard", "random")  # "": no rotation (rotate.py)
ROTATE_SCOPES = ("r1", "r2", "r1+r2")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def default_grid(method: str) -> str:
    """output (clip.py) where there are calibration inputs to score by, else mse. On SmolLM2-135M
    INT4 g128 sym the output grid took GPTQ from +38.8% to +28.4% perplexity on the licenses text,
    AWQ from +41.8% to +37.3% and AWQ+GPTQ from +40.2% to +30.6% (their previous defaults: mse,
    min/max, min/max); a weight-space search (mse) clips the very weights AWQ scaled up."""
    return "mse" if method == "rtn" else "output"


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '4096' -> 4096 (bytes)."""
    m = _SIZE.match(str(text))
    if not m:
        raise FlotillaError(f"--shard-size {text!r} is not a size; expected a number with an optional unit "
                            "such as 2GB, 500MB or 1GiB")
    unit = (m.group(2) or "").lower()
    unit = unit[:-1] if unit.endswith("b") and unit != "b" else unit
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise FlotillaError(f"--shard-size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class QuantizeOptions:
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel; a size that does not divide a linear's input
    #                        leaves a partial last group (g_idx says which group each input row is in)
    method: str = "gptq"
    sym: bool = True
    act_order: bool = False
    grid: str = ""  # output: each group's clipping range searched for the least output error (clip.py);
    #                 mse: for the least |w - w_hat|^2.4; minmax: span min..max;
    #                 "": the method's default (default_grid)
    damp_percent: float = 0.01  # of the Hessian's mean diagonal; raised if Cholesky fails
    block_size: int = 128  # GPTQ's lazy-update block (rounded to whole groups)
    calib_file: Path | None = None  # text or JSONL; None: text sampled from the model itself
    calib_samples: int = 128
    calib_seq_len: int = 128
    seed: int = 0
    shard_size: int = 2 * 10**9
    device: str = "cpu"
    force: bool = False
    keep: tuple[tuple[int, str], ...] = field(default=())  # (bits, regex over checkpoint module names)
    sensitive: int = 0  # this many linears, those of largest measured INT4 error, kept at 8 bits
    lm_head_bits: int | None = None  # the lm_head quantized too (quantize/head.py); None: fp16
    rotate: str = ""  # hadamard or random: rotate the model first (rotate.py); "": not
    rotate_scope: str = "r1+r2"  # r1: the residual stream only; r2: each head's values only; r1+r2: both
    rotate_all: bool = False  # R1 rotates the channels the norms suppress too (rotate.outlier_channels)
    rotate_tied_head: bool = False  # R1 keeps a tied lm_head tied: the final norm becomes a matrix (rotate.py)
    fp_targets: bool = False  # GPTQ fits each linear to the float model's output on the float model's inputs

    def __post_init__(self):
        if not self.grid:
            object.__setattr__(self, "grid", default_grid(self.method))
        checks = [
            (self.bits in BITS, f"--bits {self.bits} is not supported; choose one of {', '.join(map(str, BITS))}"),
            (self.group_size == -1 or (self.group_size > 0 and self.group_size % GROUP_MULTIPLE == 0),
             f"--group-size {self.group_size} is not supported; choose -1 (per channel) or a positive multiple of "
             f"{GROUP_MULTIPLE} such as 32, 64 or 128"),
            (self.method in METHODS, f"--method {self.method!r} is not a method; choose one of {', '.join(METHODS)}"),
            (self.grid in GRIDS, f"--grid {self.grid!r} is not a grid; choose one of {', '.join(GRIDS)}"),
            (self.uses_activations or self.grid != "output",
             "--grid output chooses each group's range by the error of the linear's output on the calibration "
             "inputs; --method rtn has none (choose gptq, awq or awq+gptq, or --grid mse)"),
            (self.method in ("gptq", "awq+gptq") or not self.act_order,
             "--act-order needs --method gptq or awq+gptq (it orders GPTQ's columns)"),
            (self.rotate in ROTATIONS, f"--rotate {self.rotate!r} is not a rotation; choose hadamard or random "
             "(a bare --rotate takes the next word as its value: put it after SRC)"),
            (self.rotate_scope in ROTATE_SCOPES,
             f"--rotate-scope {self.rotate_scope!r} is not a scope; choose {', '.join(ROTATE_SCOPES)}"),
            (self.rotate or not self.rotate_all, "--rotate-all-channels needs --rotate"),
            (self.rotate or self.rotate_scope == "r1+r2", "--rotate-scope needs --rotate"),
            (self.rotate or not self.rotate_tied_head, "--rotate-tied-head needs --rotate"),
            ("r1" in self.rotate_scope or not self.rotate_tied_head,
             f"--rotate-tied-head keeps the lm_head that R1 unties tied; --rotate-scope {self.rotate_scope} has no R1 "
             "and keeps a tied head tied already (drop --rotate-tied-head)"),
            (self.method in ("gptq", "awq+gptq") or not self.fp_targets,
             "--fp-targets changes the weights GPTQ rounds; it needs --method gptq or awq+gptq"),
            (self.sensitive >= 0, f"--sensitive {self.sensitive} must be 0 or more"),
            (self.lm_head_bits in (None, *BITS),
             f"--lm-head-bits {self.lm_head_bits} is not supported; choose one of {', '.join(map(str, BITS))}"),
            (0 < self.damp_percent < 1, f"--damp-percent {self.damp_percent} must be in (0, 1)"),
            (self.calib_samples >= 1, f"--calib-samples {self.calib_samples} must be at least 1"),
            (self.calib_seq_len >= 2, f"--calib-seq-len {self.calib_seq_len} must be at least 2"),
            (self.shard_size > 0, f"--shard-size {self.shard_size} must be positive"),
            (self.device.split(":")[0] in DEVICES, f"--device {self.device!r} is not a device; choose cpu or cuda"),
        ]
        for ok, message in checks:
            if not ok:
                raise FlotillaError(message)
        for bits, pattern in self.keep:
            if bits not in KEEP_BITS or bits <= self.bits:
                raise FlotillaError(f"--keep {bits}:{pattern}: keep linears at 8 bits or 16 (unquantized fp16), "
                                    f"more than --bits {self.bits}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise FlotillaError(f"--keep {bits}:{pattern}: not a regular expression ({e})") from None
        if self.sensitive and self.bits == 8:
            raise FlotillaError("--sensitive keeps linears at 8 bits; it needs --bits 4")

    @staticmethod
    def parse_keep(text: str) -> tuple[int, str]:
        """'8:.*down_proj' -> (8, '.*down_proj')."""
        bits, sep, pattern = text.partition(":")
        if not sep or not bits.strip().isdigit() or not pattern:
            raise FlotillaError(f"--keep {text!r}: expected BITS:PATTERN, e.g. 8:'.*\\.mlp\\.down_proj' "
                                "(PATTERN a regex over names like model.layers.0.self_attn.q_proj)")
        return int(bits), pattern

    @property
    def needs_calibration(self) -> bool:
        """Calibration tokens: for the method's activations or for measuring --sensitive."""
        return self.uses_activations or self.sensitive > 0

    @property
    def uses_activations(self) -> bool:
        """The method sees each layer's calibration inputs (all but RTN)."""
        return self.method != "rtn"

    @property
    def label(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = (" act-order" if self.act_order else "") + (" fp-targets" if self.fp_targets else "")
        grid = "" if self.grid == default_grid(self.method) else f" {self.grid}"
        mixed = "".join(f" keep {b}:{p}" for b, p in self.keep) + (f" sensitive {self.sensitive}" if self.sensitive else "")
        rotated = "" if not self.rotate else (f" rotated {self.rotate} {self.rotate_scope}" + " all" * self.rotate_all
                                              + " tied-head" * self.rotate_tied_head)
        return (f"INT{self.bits} {self.method.upper()} {group} {'sym' if self.sym else 'asym'}{grid}{extra}{mixed}"
                f"{rotated}")
