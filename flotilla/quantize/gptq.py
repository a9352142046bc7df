"""GPTQ (Frantar et al., 2022): quantize a linear's weights column by column, each time pushing
the rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the
layer's reconstruction error, H = 2 X Xᵀ over the calibration inputs X.

    W [out, in], H [in, in]
    H += damp * mean(diag H) * I      (damp raised tenfold while the Cholesky factorisation fails)
    U = chol(H⁻¹)ᵀ (upper)            the rows of U drive the error updates
    for each block of `block_size` columns (lazy batch updates: the block is updated column by
    column; the columns after it once per block, by one matmul):
        for each column j:  q_j = quant(w_j);  e = (w_j - q_j) / U[j, j];  w_{j:} -= e ⊗ U[j, j:]

Output channels (rows of W) are independent given H, so a merged linear (q/k/v, gate/up) is
quantized at once with the Hessian of its shared input and equals quantizing each projection
apart. With act-order, columns are visited by decreasing diag(H) and groups are consecutive in
that order; `g_idx` records the group of every original column, which is how the format carries it.
A group size that does not divide `in` leaves the last group short (its grid spans the columns it
has); the lazy-update block is rounded to whole groups.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from flotilla.kernels.gptq import group_width

from .clip import gptq_group_params, output_clip_params
from .grid import GridSpec, QuantizedWeight, dequantize_codes, grid_params, quantize_codes

log = logging.getLogger(__name__)

MAX_DAMP_TRIES = 6


class HessianAccumulator:
    """Accumulates H = 2/n Σ x xᵀ over the rows x of every batch fed to a linear; with `cross`,
    also E = 2/n Σ (x_fp - x) xᵀ against the float model's inputs x_fp of the same rows (fp_target)."""

    def __init__(self, in_features: int, device: torch.device | str, cross: bool = False):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.E = torch.zeros_like(self.H) if cross else None
        self.count = 0

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.H.device, dtype=torch.float32)  # [N, in]
        self.H.addmm_(x.t(), x)
        if self.E is not None:
            d = x_fp.reshape(x.shape).to(device=self.H.device, dtype=torch.float32) - x  # the inputs' error [N, in]
            self.E.addmm_(d.t(), x)
        self.count += x.shape[0]

    def fp_target(self, W: torch.Tensor, damp_percent: float) -> torch.Tensor:
        """The weights whose output on these inputs x is nearest the float model's output W x_fp
        (least squares, ridge-damped toward W as GPTQ damps H): Ŵ = W + W E (H + λI)⁻¹. Since
        the residual W x_fp - Ŵ x is orthogonal to the inputs, GPTQ's error against Ŵ plus a
        constant is the error against the float model's output (GPTAQ's asymmetric calibration)."""
        H, E = self.hessian(), self.E * (2.0 / self.count)
        W = W.detach().to(torch.float32)
        lam = damp_percent * H.diagonal().mean()
        if not lam > 0:
            raise ValueError("every calibration input of this linear is zero: nothing to fit its output to")
        eye = torch.eye(H.shape[0], device=H.device, dtype=H.dtype)
        L, info = torch.linalg.cholesky_ex(H + lam * eye)  # positive definite: H is a Gram matrix, λ > 0
        if int(info):
            raise ValueError(f"the damped Hessian is not positive definite (damp {damp_percent:.3g})")
        # W E (H + λI)⁻¹ = ((H + λI)⁻¹ Eᵀ Wᵀ)ᵀ
        return W + torch.cholesky_solve(E.t() @ W.t(), L).t()

    def hessian(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration rows reached this linear")
        return self.H * (2.0 / self.count)


@dataclass(frozen=True)
class GPTQResult:
    weight: QuantizedWeight
    damp_percent: float  # the damping that made H positive definite (>= the one asked for)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: GridSpec, group_size: int,
                  damp_percent: float = 0.01, block_size: int = 128, act_order: bool = False) -> GPTQResult:
    """Quantize W [out, in] given the Hessian H [in, in] of its input."""
    W = W.detach().to(torch.float32).clone()
    H = H.to(device=W.device, dtype=torch.float32).clone()
    out_f, in_f = W.shape
    gs = group_width(in_f, group_size)
    if group_size != -1:  # a block holds whole groups: a group's grid is chosen from its updated columns
        block_size = gs * max(1, round(block_size / gs))

    dead = H.diagonal() == 0  # inputs that are always zero: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(in_f, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    U, damp = _inverse_cholesky_upper(H, damp_percent)

    groups = -(-in_f // gs)
    scales = torch.empty(groups, out_f, device=W.device)
    zeros = torch.empty(groups, out_f, device=W.device)
    codes = torch.empty(out_f, in_f, device=W.device)  # in visiting order
    searched = spec.grid == "output"
    if group_size == -1:  # one grid per channel, chosen before any update (by output error: clip.py)
        params = output_clip_params(W, H, spec, -1) if searched else grid_params(W, spec)
        scales[0], zeros[0] = (p.reshape(-1) for p in params)
    for b0 in range(0, in_f, block_size):
        b1 = min(b0 + block_size, in_f)
        W1 = W[:, b0:b1].clone()
        U1 = U[b0:b1, b0:b1]
        err = torch.empty_like(W1)
        for i in range(b1 - b0):
            col = b0 + i
            g = col // gs
            if group_size != -1 and col % gs == 0:  # a group starts: its grid from the updated weights
                group = W1[:, i:i + gs]
                scales[g], zeros[g] = gptq_group_params(group, U1[i:i + gs, i:i + gs], spec) if searched \
                    else grid_params(group, spec)
            w = W1[:, i]
            q = quantize_codes(w, scales[g], zeros[g], spec.maxq)
            codes[:, col] = q
            e = (w - dequantize_codes(q, scales[g], zeros[g])) / U1[i, i]
            W1[:, i:].addr_(e, U1[i, i:], alpha=-1)
            err[:, i] = e
        W[:, b1:].addmm_(err, U[b0:b1, b1:], alpha=-1)

    inv = torch.argsort(perm)
    g_idx = (torch.arange(in_f, device=W.device) // gs)[inv]  # group of each original column
    weight = QuantizedWeight(codes[:, inv].to(torch.int32), zeros.to(torch.int32), scales,
                             g_idx.to(torch.int32), spec.bits, group_size)
    return GPTQResult(weight, damp)


def _inverse_cholesky_upper(H: torch.Tensor, damp_percent: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)⁻¹, raising damp tenfold until H + damp I is
    positive definite."""
    mean_diag = H.diagonal().mean()
    eye = torch.eye(H.shape[0], device=H.device, dtype=H.dtype)
    damp = damp_percent
    for _ in range(MAX_DAMP_TRIES):
        L, info = torch.linalg.cholesky_ex(H + damp * mean_diag * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U, damp
        log.warning("GPTQ: Hessian not positive definite with damp %.3g; raising it", damp)
        damp *= 10
    raise ValueError(f"the Hessian stays singular even with damp {damp / 10:.3g}; "
                     "the calibration data may be degenerate")
