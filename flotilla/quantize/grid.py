"""The integer grid of one group of weights, and the quantized result of one linear.

A weight w of output channel o in group g is stored as a code q in [0, 2**bits - 1]:

    w_hat = scale[g, o] * (q - zero[g, o])

Symmetric: zero = 2**(bits-1), so q - zero spans [-2**(bits-1), 2**(bits-1) - 1], and the scale is
the smallest that reaches both ends of the group without clipping: max(-min(w) / 2**(bits-1),
max(w) / (2**(bits-1) - 1)). (GPTQ's reference takes 2 * max|w| / (2**bits - 1), which clips a
group's largest positive weight by 1/15 at 4 bits and wastes the extra negative code otherwise; on
SmolLM2-135M INT4 g64 RTN this grid lowers perplexity by about 9%. Readers only see scale and zero.)
Asymmetric: scale = (max(w, 0) - min(w, 0)) / (2**bits - 1), zero = round(-min(w, 0) / scale).

That is the `minmax` grid. The default, `mse`, tries the range shrunk by 1.00, 0.98, ... 0.50 for
each group and keeps the one with the least sum |w - w_hat|^2.4 (GPTQ's reference norm): clipping a
few outlying weights buys a finer grid for all the others. On SmolLM2-135M INT4 g64 it lowers the
perplexity of RTN by 1-3% and of GPTQ by 0-5% (bench/quality.py).

Two constraints of the file format shape the grid, and are applied here so that what the
quantizer computes is exactly what a reader of the file gets back:

- scales are stored in fp16, so they are rounded to fp16 (and kept at least fp16's smallest
  normal, never 0) before any code is chosen;
- the gptq ("v1") checkpoint format stores zero - 1, and every reader adds 1 back without
  masking, so a zero point must lie in [1, 2**bits - 1]. An asymmetric group whose minimum is
  (nearly) 0 would get zero = 0; it is clamped to 1 and its scale widened to max(w) / (2**bits - 2)
  so that the group's maximum still fits the top code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flotilla.kernels.gptq import GPTQWeight, default_g_idx, group_width, num_groups

FP16_TINY = torch.finfo(torch.float16).tiny
FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class GridSpec:
    bits: int
    sym: bool
    grid: str = "minmax"  # minmax: each group's min..max; mse: the range searched by weight error
    #                       (search_params); output: searched by output error (clip.py, given the inputs)

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1


def find_params(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of w [rows, n] (one group of each output channel).

    Returns fp32 scales that are exact fp16 values, and integer-valued fp32 zeros."""
    return range_params(w.min(dim=1).values, w.max(dim=1).values, spec)


def range_params(wmin: torch.Tensor, wmax: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of rows whose weights span [wmin, wmax] (the range always includes 0)."""
    maxq = spec.maxq
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    if spec.sym:
        half = (maxq + 1) // 2  # codes - zero span [-half, half - 1]
        scale = _to_fp16_grid(torch.maximum(-wmin / half, wmax / (half - 1)))
        return scale, torch.full_like(scale, half)
    scale = _to_fp16_grid((wmax - wmin) / maxq)
    zero = torch.round(-wmin / scale)
    low = zero < 1  # format constraint: zero - 1 must be storable
    if bool(low.any()):
        scale = torch.where(low, _to_fp16_grid(wmax / (maxq - 1)), scale)
        zero = torch.where(low, torch.ones_like(zero), zero)
    return scale, zero.clamp(1, maxq)


CLIP_SHRINKS = tuple(1.0 - 0.02 * i for i in range(26))  # 1.00, 0.98, ... 0.50
CLIP_NORM = 2.4
SEARCH_CHUNK = 1 << 18  # elements of w searched at a time on a CPU (stays in cache across the candidates)
SEARCH_CHUNK_GPU = 1 << 24  # on a GPU: few, large kernels


def grid_params(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of each row of w under spec from w alone: searched for `mse`, else min/max (the
    `output` grid is searched by the caller, who has the inputs: clip.py)."""
    return search_params(w, spec) if spec.grid == "mse" else find_params(w, spec)


def search_params(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Like find_params, but each row's range is shrunk by the factor in CLIP_SHRINKS that
    minimises sum |w - w_hat|^2.4 over the row (clipping a few outliers buys a finer grid for
    the rest; the norm is GPTQ's reference choice). Shrink 1.0 is find_params itself; on ties
    the widest range wins."""
    w = w.float()
    chunk_elems = SEARCH_CHUNK if w.device.type == "cpu" else SEARCH_CHUNK_GPU
    rows_per_chunk = max(1, chunk_elems // max(1, w.shape[1]))
    scales, zeros = [], []
    for r0 in range(0, w.shape[0], rows_per_chunk):
        chunk = w[r0:r0 + rows_per_chunk]
        wmin, wmax = chunk.min(dim=1).values, chunk.max(dim=1).values
        scratch = torch.empty_like(chunk)
        best = None
        for shrink in CLIP_SHRINKS:
            scale, zero = range_params(wmin * shrink, wmax * shrink, spec)
            err = _grid_error(chunk, scale, zero, spec.maxq, scratch)
            if best is None:
                best = [scale, zero, err]
                continue
            better = err < best[2]
            best[0] = torch.where(better, scale, best[0])
            best[1] = torch.where(better, zero, best[1])
            best[2] = torch.minimum(err, best[2])
        scales.append(best[0])
        zeros.append(best[1])
    return torch.cat(scales), torch.cat(zeros)


def _grid_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int,
                out: torch.Tensor) -> torch.Tensor:
    """sum |w - w_hat|^CLIP_NORM per row, computed in `out` (a scratch tensor shaped like w)."""
    s, z = scale.unsqueeze(1), zero.unsqueeze(1)
    torch.div(w, s, out=out)
    out.round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s).sub_(w).abs_().pow_(CLIP_NORM)
    return out.sum(dim=1)


def _to_fp16_grid(scale: torch.Tensor) -> torch.Tensor:
    if bool((scale > FP16_MAX).any()) or not bool(torch.isfinite(scale).all()):
        raise ValueError("weights too large (or not finite) for fp16 scales")
    return scale.clamp(min=FP16_TINY).to(torch.float16).to(torch.float32)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer-valued fp32 codes of w; scale and zero broadcast against w."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - zero) * scale in fp32: the arithmetic of flotilla.kernels.reference.dequantize, so the
    values match a reader of the checkpoint bit for bit."""
    return (q - zero) * scale


@dataclass(frozen=True)
class QuantizedWeight:
    """The quantized form of one (possibly merged) linear, in the model's [out, in] orientation."""

    codes: torch.Tensor  # int32 [out, in]
    zeros: torch.Tensor  # int32 [groups, out]
    scales: torch.Tensor  # fp32 [groups, out], every value an exact fp16
    g_idx: torch.Tensor  # int32 [in]: the group of each input column
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The weights a reader of the checkpoint gets back, fp32 [out, in]."""
        g = self.g_idx.long()
        zeros = self.zeros.index_select(0, g).t()  # [out, in]
        scales = self.scales.index_select(0, g).t()
        return (self.codes - zeros).to(torch.float32) * scales

    def to_gptq(self, rows: slice = slice(None)) -> GPTQWeight:
        """The GPTQ tensors of output channels `rows` (one projection of a merged linear)."""
        return GPTQWeight.from_codes(self.codes[rows].t().contiguous().cpu(), self.zeros[:, rows].cpu(),
                                     self.scales[:, rows].cpu(), self.g_idx.cpu(), self.bits, self.group_size)


def fake_quantize(w: torch.Tensor, spec: GridSpec, group_size: int) -> torch.Tensor:
    """rtn_quantize(w, spec, group_size).dequantize() on the min/max grid, without the codes: the
    fast inner step of searches that try many candidate weights (AWQ's scales)."""
    out_f, in_f = w.shape
    gs = group_width(in_f, group_size)
    groups = num_groups(in_f, group_size)
    w = w.float() if groups * gs == in_f else F.pad(w.float(), (0, groups * gs - in_f))  # zeros pad a partial group
    wg = w.view(out_f, groups, gs)
    scale, zero = range_params(wg.amin(dim=2).flatten(), wg.amax(dim=2).flatten(), spec)
    scale, zero = scale.view(out_f, groups, 1), zero.view(out_f, groups, 1)
    q = torch.div(wg, scale).round_().add_(zero).clamp_(0, spec.maxq).sub_(zero).mul_(scale)
    return q.view(out_f, groups * gs)[:, :in_f]


def rtn_quantize(w: torch.Tensor, spec: GridSpec, group_size: int,
                 params: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantizedWeight:
    """Round-to-nearest of w [out, in] with one grid per output channel and input group: `params`
    (scales and zeros [groups, out]) where given, else grid_params of each group."""
    out_f, in_f = w.shape
    gs = group_width(in_f, group_size)
    groups = num_groups(in_f, group_size)
    # a partial last group is padded with zeros: every grid holds 0 exactly (its range always
    # includes 0 and the zero point is an integer), so the padding changes neither grid nor error
    w = F.pad(w.float(), (0, groups * gs - in_f))  # [out, groups * gs]
    wg = w.reshape(out_f, groups, gs).transpose(0, 1)  # [groups, out, gs]
    if params is None:
        scale, zero = grid_params(wg.reshape(groups * out_f, gs), spec)
        scale, zero = scale.view(groups, out_f), zero.view(groups, out_f)
    else:
        scale, zero = params
    codes = quantize_codes(wg, scale.unsqueeze(-1), zero.unsqueeze(-1), spec.maxq)  # [groups, out, gs]
    codes = codes.transpose(0, 1).reshape(out_f, groups * gs)[:, :in_f]
    return QuantizedWeight(codes.to(torch.int32), zero.to(torch.int32), scale,
                           default_g_idx(in_f, group_size, w.device), spec.bits, group_size)
