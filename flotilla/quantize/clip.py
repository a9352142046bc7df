"""Clipping ranges chosen by the error of the linear's OUTPUT on the calibration inputs (`--grid output`).

The `mse` grid shrinks each group's range to the least weight error, blind to which weights matter:
after AWQ it clips exactly the input channels AWQ scaled up for carrying large activations. Here
each (output channel, group) keeps the shrink of least error in what the group adds to the output,
as AutoAWQ's clip search scores it (its ratios 1.00, 0.95, ... 0.55; its `n_grid` 20, `max_shrink`
0.5), but over every calibration token through the group's block of H = XᵀX instead of 512 sampled
ones:

    err(o, g, r) = δ H_gg δᵀ,   δ = Q_r(w_og) − w_og   (the group's columns of output channel o)

For RTN (and AWQ's rounding) Q_r is rounding on the range shrunk by r. For GPTQ the group's
columns are not rounded independently: each column's error moves onto the columns after it. There
the shrink is chosen when the group starts, by GPTQ's own loss over the group, Σ_j e_j² with
e_j = (w_j − q_j) / U_jj, running the group's column loop once per candidate shrink (all candidates
side by side) on the weights as GPTQ has updated them so far (`gptq_group_params`).

Shrink 1.0 is the min/max grid itself, so neither search scores worse than min/max on its own
criterion; on ties the widest range wins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.gptq import group_width, num_groups

from .grid import GridSpec, dequantize_codes, quantize_codes, range_params

RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # AutoAWQ's: 1.00, 0.95, ... 0.55
SUB_BLOCK = 16  # columns of a group updated one by one in gptq_group_params; the rest lazily


def output_clip_params(w: torch.Tensor, H: torch.Tensor, spec: GridSpec, group_size: int,
                       ratios: tuple[float, ...] = RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [groups, out] of w [out, in] whose shrink of each group's range has the least
    δ H_gg δᵀ (module docstring). H [in, in]: the Hessian (any positive multiple) of w's input."""
    out_f, in_f = w.shape
    gs = group_width(in_f, group_size)
    groups = num_groups(in_f, group_size)
    pad = groups * gs - in_f  # a partial last group: zero weights and zero H rows add nothing
    wg = F.pad(w.float(), (0, pad)).view(out_f, groups, gs).transpose(0, 1)  # [groups, out, gs]
    Hp = F.pad(H.float(), (0, pad, 0, pad))
    blocks = torch.stack([Hp[g * gs:(g + 1) * gs, g * gs:(g + 1) * gs] for g in range(groups)])  # [groups, gs, gs]
    wmin, wmax = wg.amin(dim=2), wg.amax(dim=2)  # [groups, out]
    best = None
    for r in ratios:
        scale, zero = range_params(wmin * r, wmax * r, spec)
        delta = dequantize_codes(quantize_codes(wg, scale.unsqueeze(-1), zero.unsqueeze(-1), spec.maxq),
                                 scale.unsqueeze(-1), zero.unsqueeze(-1)).sub_(wg)  # [groups, out, gs]
        err = torch.bmm(delta, blocks).mul_(delta).sum(dim=2)  # [groups, out]
        if best is None:
            best = [scale, zero, err]
            continue
        better = err < best[2]
        best = [torch.where(better, scale, best[0]), torch.where(better, zero, best[1]), torch.minimum(err, best[2])]
    return best[0], best[1]


def gptq_group_params(w: torch.Tensor, U: torch.Tensor, spec: GridSpec,
                      ratios: tuple[float, ...] = RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [out] for the group of GPTQ's (updated) columns w [out, n] whose rows of the
    inverse-Hessian Cholesky factor are U [n, n] (the group's diagonal block): per output channel,
    the shrink whose run of GPTQ's column loop over the group has the least Σ_j e_j²."""
    R, (out_f, n) = len(ratios), w.shape
    r = torch.tensor(ratios, dtype=torch.float32, device=w.device).view(R, 1)
    scale, zero = range_params((w.amin(dim=1) * r).flatten(), (w.amax(dim=1) * r).flatten(), spec)
    scale, zero = scale.view(R, out_f), zero.view(R, out_f)
    W = w.float().unsqueeze(0).repeat(R, 1, 1)  # [R, out, n]: one copy of the group per candidate
    loss = torch.zeros(R, out_f, device=w.device)
    for b0 in range(0, n, SUB_BLOCK):  # lazy updates, as GPTQ's blocks: columns past the sub-block
        b1 = min(b0 + SUB_BLOCK, n)    # get its errors in one matmul, not one update per column
        E = torch.empty(R, out_f, b1 - b0, device=w.device)
        for j in range(b0, b1):
            col = W[:, :, j]
            e = (col - dequantize_codes(quantize_codes(col, scale, zero, spec.maxq), scale, zero)) / U[j, j]
            loss.addcmul_(e, e)
            E[:, :, j - b0] = e
            if j + 1 < b1:
                W[:, :, j + 1:b1].sub_(e.unsqueeze(-1) * U[j, j + 1:b1])
        if b1 < n:
            W[:, :, b1:].sub_(E @ U[b0:b1, b1:])  # [R, out, sub] @ [sub, rest]
    # the first minimum along R: ratios run from the widest range down, so ties keep the wider one
    pick = loss.argmin(dim=0, keepdim=True)  # [1, out]
    return scale.gather(0, pick).squeeze(0), zero.gather(0, pick).squeeze(0)
