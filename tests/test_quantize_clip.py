"""The output-error clipping search (`--grid output`): each group's range chosen by what its rounding
does to the linear's output, checked against a brute-force search over the calibration rows."""
from __future__ import annotations

import pytest
import torch

from flotilla.kernels.gptq import GPTQWeight
from flotilla.kernels.reference import dequantize
from flotilla.quantize import QuantizeOptions
from flotilla.errors import FlotillaError
from flotilla.quantize.clip import RATIOS, gptq_group_params, output_clip_params
from flotilla.quantize.gptq import HessianAccumulator, gptq_quantize
from flotilla.quantize.grid import GridSpec, find_params, rtn_quantize, search_params


def salient_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs whose channel energies span 100x, a few channels far above the rest."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim ** 0.5
    scale = 0.1 + 2 * torch.rand(dim, generator=g)
    scale[torch.randperm(dim, generator=g)[:dim // 32]] = 10.0
    return (torch.randn(n, dim, generator=g) @ mix + torch.randn(n, dim, generator=g)) * scale


def brute_force(w: torch.Tensor, X: torch.Tensor, spec: GridSpec, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel and group: every ratio's range, rounded, scored by the group's share of
    the output over the rows of X, ‖X_g (Q_r(w_og) − w_og)ᵀ‖²; the first best kept."""
    out_f, in_f = w.shape
    groups = -(-in_f // gs)
    scales, zeros = torch.empty(groups, out_f), torch.empty(groups, out_f)
    for g in range(groups):
        cols = slice(g * gs, min((g + 1) * gs, in_f))
        for o in range(out_f):
            row = w[o:o + 1, cols]
            best = None
            for r in RATIOS:
                s, z = find_params(row * r, spec)  # the range of the row shrunk by r
                q = (torch.clamp(torch.round(row / s[:, None]) + z[:, None], 0, spec.maxq) - z[:, None]) * s[:, None]
                err = float(((X[:, cols] @ (q - row).t()) ** 2).sum())
                if best is None or err < best[0]:
                    best = (err, s, z)
            scales[g, o], zeros[g, o] = best[1], best[2]
    return scales, zeros


@pytest.mark.parametrize("sym,gs", [(True, 64), (False, 48)])
def test_output_clip_picks_the_brute_force_ratio(sym, gs):
    """H's diagonal blocks give exactly the error a pass over the tokens gives (48: a partial last group)."""
    X = salient_inputs(512, 160)
    w = torch.randn(12, 160, generator=torch.Generator().manual_seed(1)) * 0.05
    w[:, 7] *= 6  # outlier weights: worth clipping where their input is small
    spec = GridSpec(4, sym, grid="output")
    scale, zero = output_clip_params(w, X.t() @ X, spec, gs)
    want_scale, want_zero = brute_force(w, X, spec, gs)
    assert torch.equal(scale, want_scale) and torch.equal(zero, want_zero)
    assert bool((scale < rtn_quantize(w, GridSpec(4, sym), gs).scales).any())  # some groups did clip


def test_output_clip_keeps_salient_weights_that_the_weight_error_search_clips():
    """One large weight per row on a channel of large activations: rounding it matters most, so the
    output search keeps the full range; the weight-error (mse) search clips it to serve the rest."""
    dim = 64
    X = torch.randn(2048, dim, generator=torch.Generator().manual_seed(2))
    X[:, 0] *= 30
    w = torch.randn(8, dim, generator=torch.Generator().manual_seed(3)) * 0.02
    w[:, 0] = 0.25
    spec = GridSpec(4, True, grid="output")
    kept, _ = output_clip_params(w, X.t() @ X, spec, dim)
    assert torch.equal(kept[0], find_params(w, spec)[0])  # ratio 1 everywhere
    assert bool((search_params(w, GridSpec(4, True, grid="mse"))[0] < kept[0]).all())

    X[:, 0] /= 3000  # the same weights on a silent channel: now clipping it is the better trade
    clipped, _ = output_clip_params(w, X.t() @ X, spec, dim)
    assert bool((clipped[0] < kept[0]).all())


def gptq_group_reference(w: torch.Tensor, U: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One ratio and one output channel at a time: GPTQ's column loop over the group, Σ e² scored."""
    scales, zeros = torch.empty(w.shape[0]), torch.empty(w.shape[0])
    for o in range(w.shape[0]):
        best = None
        for r in RATIOS:
            s, z = find_params(w[o:o + 1] * r, spec)
            row, loss = w[o].clone(), 0.0
            for j in range(w.shape[1]):
                q = (torch.clamp(torch.round(row[j] / s) + z, 0, spec.maxq) - z) * s
                e = (row[j] - q) / U[j, j]
                loss += float(e ** 2)
                row[j:] -= e * U[j, j:]
            if best is None or loss < best[0]:
                best = (loss, s, z)
        scales[o], zeros[o] = best[1], best[2]
    return scales, zeros


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_group_search_is_gptqs_own_loss(sym):
    X = salient_inputs(1024, 32, seed=5)
    H = X.t() @ X / 1024
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    w = torch.randn(10, 32, generator=torch.Generator().manual_seed(6)) * 0.05
    w[:5, 3] *= 8
    spec = GridSpec(4, sym, grid="output")
    scale, zero = gptq_group_params(w, U, spec)
    want_scale, want_zero = gptq_group_reference(w, U, spec)
    assert torch.equal(scale, want_scale) and torch.equal(zero, want_zero)


def output_error(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    return float(((X @ (W - W_hat).t()) ** 2).mean())


@pytest.mark.parametrize("sym,group,act_order", [(True, 64, False), (False, 48, True), (True, -1, False)])
def test_output_grid_lowers_gptq_and_rtn_output_error_and_stays_format_exact(sym, group, act_order):
    X = salient_inputs(2048, 192, seed=7)
    W = torch.randn(48, 192, generator=torch.Generator().manual_seed(8)) * 0.05
    W[torch.rand(48, 192, generator=torch.Generator().manual_seed(9)) < 0.01] *= 8  # scattered outliers
    acc = HessianAccumulator(192, "cpu")
    acc.add(X)
    errors = {}
    for grid in ("minmax", "mse", "output"):
        spec = GridSpec(4, sym, grid=grid)
        q = gptq_quantize(W, acc.hessian(), spec, group, act_order=act_order).weight
        errors[grid] = output_error(X, W, q.dequantize())
        packed = GPTQWeight.from_codes(q.codes.t().contiguous(), q.zeros, q.scales, q.g_idx, 4, group)
        assert torch.equal(dequantize(packed).t(), q.dequantize())  # what a reader of the file decodes
    assert errors["output"] < errors["minmax"] and errors["output"] < errors["mse"]
    spec = GridSpec(4, sym, grid="output")
    rtn = rtn_quantize(W, spec, group, output_clip_params(W, acc.hessian(), spec, group))
    assert output_error(X, W, rtn.dequantize()) < output_error(X, W, rtn_quantize(W, GridSpec(4, sym), group).dequantize())


def test_output_grid_needs_calibration_inputs():
    with pytest.raises(FlotillaError, match="--grid output"):
        QuantizeOptions(method="rtn", grid="output")
    assert QuantizeOptions(method="gptq", grid="output").grid == "output"


def test_a_group_wider_than_the_input_is_the_per_channel_grid():
    """A group at least as wide as the input is one group: the same codes and scales as -1 (and no
    padding to the group's width, which made a 4096-wide group on 576 inputs ~5x slower)."""
    import torch

    from flotilla.kernels.gptq import group_width
    from flotilla.quantize.grid import GridSpec, rtn_quantize

    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    for spec in (GridSpec(4, True), GridSpec(4, False, "mse")):
        wide, per_channel = rtn_quantize(w, spec, 4096), rtn_quantize(w, spec, -1)
        assert torch.equal(wide.codes, per_channel.codes) and torch.equal(wide.scales, per_channel.scales)
    assert (group_width(576, 4096), group_width(576, -1), group_width(576, 128)) == (576, 576, 128)
