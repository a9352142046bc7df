"""bitsandbytes' linears, as transformers saves them, read into the GPTQ layout of flotilla's kernels.

4-bit (`load_in_4bit`, NF4 or FP4), per projection P:

    P.weight                          uint8 [out * in / 2, 1]: the codes of W [out, in] flattened
                                      row-major, two per byte, the first in the high nibble
    P.weight.quant_map                fp32 [16]: the value of each code (NF4 or FP4 levels)
    P.weight.absmax                   fp32 [blocks]: one per `blocksize` consecutive codes; with
                                      nested ("double") quantization uint8 [blocks], and then
    P.weight.nested_quant_map         fp32 [256], and
    P.weight.nested_absmax            fp32 [blocks / nested_blocksize]
    P.weight.quant_state.bitsandbytes__nf4 (or __fp4)
                                      uint8: JSON {quant_type, blocksize, dtype, shape,
                                      nested_blocksize, nested_offset, ...}

    W.flat[b * blocksize + j] = quant_map[code] * absmax[b]
    nested: absmax[b] = nested_quant_map[absmax_u8[b]] * nested_absmax[b // nested_blocksize] + nested_offset

8-bit (`load_in_8bit`, LLM.int8): P.weight int8 [out, in], P.SCB fp32 [out], P.weight_format
(uint8, 0: row-major). W = weight * SCB[:, None] / 127.

Into the kernels, both as INT8 (zeros stored as they are, gptq_v2), symmetric, zero 128:

    8-bit   one group per output channel: q = weight + 128, scale = SCB / 127. Exact but for the
            fp16 scale (a relative 2^-11 at most).
    4-bit   one group per block (`blocksize` inputs of one row: in % blocksize == 0). NF4 and FP4
            levels are not evenly spaced, so no INT4 grid holds them; on an INT8 grid of step
            `δ` (chosen once per quant_map to put the 16 levels nearest the integers, |level/δ|
            <= 127), q = round(level / δ) + 128 and scale = absmax * δ (fp16). The weight error is
            at most absmax * (level_error(δ) + 2^-11): 0.0034 absmax for NF4 (δ = 1/123.2, level
            error 0.0029) and FP4, a few percent of NF4's own steps (0.08-0.3 absmax); the weights
            take 8 bits each (twice bitsandbytes' 4), run by flotilla's W8 kernels.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight, default_g_idx

Getter = Callable[[str], torch.Tensor]
STATE = ".weight.quant_state.bitsandbytes__"  # + nf4 / fp4
ZERO = 128


@dataclass(frozen=True)
class Bnb4State:
    """The JSON of `P.weight.quant_state.bitsandbytes__<type>`."""

    quant_type: str
    blocksize: int
    shape: tuple[int, int]  # [out, in]
    nested_blocksize: int = 0  # 0: absmax stored in fp32
    nested_offset: float = 0.0

    @classmethod
    def read(cls, get: Getter, prefix: str, names: set[str]) -> "Bnb4State":
        name = next((prefix + STATE + t for t in ("nf4", "fp4") if prefix + STATE + t in names), None)
        if name is None:
            raise FlotillaError(f"tensor {prefix}.weight: no {prefix}{STATE}nf4 (or fp4) beside it")
        try:
            d = json.loads(bytes(get(name).to(torch.uint8).tolist()).decode())
            shape = tuple(int(n) for n in d["shape"])
            state = cls(str(d["quant_type"]), int(d["blocksize"]), shape, int(d.get("nested_blocksize", 0) or 0),
                        float(d.get("nested_offset", 0.0) or 0.0))
        except (ValueError, KeyError, TypeError) as e:
            raise FlotillaError(f"tensor {name}: not a bitsandbytes quant state ({e})") from None
        if len(state.shape) != 2 or state.shape[1] % state.blocksize:
            raise FlotillaError(f"tensor {name}: shape {list(state.shape)} with blocksize {state.blocksize}: "
                                "flotilla reads 4-bit blocks that lie within one row (inputs a multiple of it)")
        return state


def stored_4bit(names: set[str]) -> set[str]:
    return {n.split(STATE)[0] for n in names if STATE in n}


def stored_8bit(names: set[str]) -> set[str]:
    return {n.removesuffix(".SCB") for n in names if n.endswith(".SCB")}


def int8_step(levels: torch.Tensor) -> float:
    """The step δ of an INT8 grid holding the 16 levels best: least max |level - δ round(level / δ)|
    over δ from max|level| / 127 (the widest level reaching ±127) to four times that."""
    levels = levels.double()
    top = float(levels.abs().max())
    deltas = torch.linspace(top / 127, 4 * top / 127, 6001, dtype=torch.float64)
    err = (levels[None, :] - deltas[:, None] * torch.round(levels[None, :] / deltas[:, None])).abs().amax(dim=1)
    return float(deltas[int(err.argmin())])


def read_4bit(get: Getter, prefix: str, names: set[str]) -> GPTQWeight:
    """Projection `prefix`'s 4-bit weight as INT8 groups of `blocksize` (module docstring)."""
    state = Bnb4State.read(get, prefix, names)
    out_f, in_f = state.shape
    packed = get(prefix + ".weight").reshape(-1)
    if packed.dtype != torch.uint8 or packed.numel() * 2 != out_f * in_f:
        raise FlotillaError(f"tensor {prefix}.weight: {packed.dtype} with {packed.numel()} values; expected "
                            f"uint8 with {out_f * in_f // 2} (two 4-bit codes each for [{out_f}, {in_f}])")
    codes = torch.stack([packed >> 4, packed & 15], dim=1).view(out_f, in_f).long()  # high nibble first
    absmax = _absmax(get, prefix, state).view(out_f, in_f // state.blocksize)  # [out, groups]
    levels = get(prefix + ".weight.quant_map").float()
    step = int8_step(levels)
    q = (torch.round(levels.double() / step).long() + ZERO)[codes]  # [out, in]
    scales = (absmax.double() * step).t()  # [groups, out]
    return GPTQWeight.from_codes(q.t(), torch.full_like(scales, ZERO, dtype=torch.int32), scales,
                                 default_g_idx(in_f, state.blocksize), 8, state.blocksize, zero_offset=0)


def _absmax(get: Getter, prefix: str, state: Bnb4State) -> torch.Tensor:
    absmax = get(prefix + ".weight.absmax")
    if not state.nested_blocksize:
        return absmax.float()
    code = get(prefix + ".weight.nested_quant_map").float()
    nested = get(prefix + ".weight.nested_absmax").float()
    blocks = torch.arange(absmax.numel()) // state.nested_blocksize
    return code[absmax.long()] * nested[blocks] + state.nested_offset


def read_8bit(get: Getter, prefix: str, names: set[str]) -> GPTQWeight:
    """Projection `prefix`'s LLM.int8 weight as INT8 per output channel (module docstring)."""
    weight, scb = get(prefix + ".weight"), get(prefix + ".SCB").float()
    if weight.dtype != torch.int8 or weight.dim() != 2 or scb.shape != weight.shape[:1]:
        raise FlotillaError(f"tensors {prefix}.weight/.SCB: {weight.dtype} {list(weight.shape)} and "
                            f"{list(scb.shape)}; expected int8 [out, in] and [out]")
    if prefix + ".weight_format" in names and int(get(prefix + ".weight_format")) != 0:
        raise FlotillaError(f"tensor {prefix}.weight_format: {int(get(prefix + '.weight_format'))}; flotilla reads "
                            "the row-major int8 layout (0) that transformers saves")
    out_f, in_f = weight.shape
    q = weight.t().to(torch.int32) + ZERO  # [in, out]
    return GPTQWeight.from_codes(q, torch.full((1, out_f), ZERO, dtype=torch.int32), (scb / 127).unsqueeze(0),
                                 default_g_idx(in_f, -1), 8, -1, zero_offset=0)
