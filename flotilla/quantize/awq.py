"""Activation-aware weight scaling (AWQ, Lin et al. 2023), folded into the layer.

A few input channels of a linear carry much larger activations than the rest, and rounding error
on their weights costs the most. AWQ multiplies those weights' input channels by s > 1 before
quantizing (finer relative grid for them) and divides the op that feeds the linear by s, so the
float layer computes exactly what it did:

    y = W x = (W diag(s)) (diag(s)⁻¹ x)

The division is folded into the op before the linear, so the checkpoint is a plain GPTQ-layout
one that any GPTQ reader decodes:

    qkv_proj      <- input_layernorm weight / s
    o_proj        <- v_proj output rows / s       (only when every o_proj input reads one v output:
                                                   as many KV heads as heads; skipped under GQA)
    gate_up_proj  <- post_attention_layernorm weight / s
    down_proj     <- up_proj output rows / s      (silu(gate) * up is linear in up)

The search, per linear, over the grid of AutoAWQ (`duo_scaling`):

    s(α) = mean|x|^α / mean_w^(1-α),  α in {0, 1/20, ..., 19/20},  normalised by sqrt(max s · min s)

where mean|x| is each input channel's mean absolute activation over the calibration tokens and
mean_w the channel's mean weight magnitude relative to its group's largest. Each candidate is
scored by the linear's output error over all calibration tokens,
‖X (Q(W diag(s)) diag(s)⁻¹ − W)ᵀ‖² = Σ ΔW H ΔWᵀ with H = XᵀX (exact, and one [in, in] matmul per
candidate instead of a pass over the tokens; over at most SEARCH_ROWS evenly strided output channels),
Q being the rounding the layer will get: round-to-nearest with each group's clipping range chosen by
output error (the `output` grid, clip.py, on the scaled input's H' = diag(s)⁻¹ H diag(s)⁻¹), or
on the min/max grid for `--grid minmax` and `--grid mse` (as AutoAWQ scores its scales). gate/up is scored where its error lands, at the MLP's
output: ‖down(silu(gate')·up') − down(silu(gate)·up)‖² over MLP_TOKENS evenly strided calibration
tokens (down in float), as AutoAWQ inspects the whole MLP: silu(gate)·up weighs gate's and up's
errors unevenly, which gate/up's own output error does not see. s = 1
(no scaling) is a candidate too, so AWQ never scores worse than plain rounding. The scaled weights
are then rounded for real (RTN, or GPTQ for awq+gptq) with each group's clipping range chosen by
the error of the linear's output, as AutoAWQ's clip search does after its scale search (the
`output` grid, clip.py, the default): a weight-space clipping search (`--grid mse`) would clip the
very weights the scales made large because their inputs are.

Scoring the candidates on the output grid instead of min/max (AutoAWQ's way), measured on
SmolLM2-135M INT4 g128 sym in `python bench/quality.py --threads 1` against the same rows of a copy
with min/max scoring, run side by side (same calibration text; load average 3-4): AWQ+GPTQ +42.2%
-> +30.5% perplexity on the licenses text, +27.2% -> +19.1% on the docs text; AWQ +37.3% -> +33.4%
and +25.2% -> +25.4%; quantize time about 1.1-1.6x.

(Measured on SmolLM2-135M INT4 g128 and not kept: scoring q/k/v's scales at the attention's output
after o_proj, as AutoAWQ inspects the whole attention: +5% perplexity against q/k/v's own output
error; scoring awq+gptq's candidates with GPTQ's rounding instead of round-to-nearest, no better
than the noise of the calibration sample and 2-3x the time.)

Norm weights are written in fp16, so a folded norm is rounded to fp16 first and s adjusted to the
rounded value: the quantizer and a reader of the checkpoint compute the same layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.fused import gelu_tanh_mul, silu_mul
from flotilla.kernels.gptq import group_width
from flotilla.models.linear import Linear
from flotilla.models.llama import DecoderLayer, RMSNorm

from .activations import CalibrationActivations
from .gptq import HessianAccumulator
from .clip import output_clip_params
from .grid import GridSpec, fake_quantize, rtn_quantize

GRID = 20
S_MIN = 1e-4
SEARCH_ROWS = 1024  # output channels scored per candidate (evenly strided; all of them in smaller linears)
MLP_TOKENS = 2048  # calibration tokens kept (evenly strided) to score gate/up at the MLP's output


@dataclass(frozen=True)
class ScaleSite:
    """A linear whose input channels AWQ scales, and the op that absorbs the inverse."""

    name: str
    linear: Linear
    norm: RMSNorm | None = None  # the RMSNorm before the linear, or
    rows_of: Linear | None = None  # the linear whose output rows `rows` feed it
    rows: slice | None = None


def scale_sites(layer: DecoderLayer) -> list[ScaleSite]:
    a, m = layer.self_attn, layer.mlp
    sites = [ScaleSite("qkv_proj", a.qkv_proj, norm=layer.input_layernorm)]
    if a.num_kv_heads == a.num_heads:
        sites.append(ScaleSite("o_proj", a.o_proj, rows_of=a.qkv_proj, rows=a.qkv_proj.shard_slice(2)))
    sites += [ScaleSite("gate_up_proj", m.gate_up_proj, norm=layer.mlp_norm),
              ScaleSite("down_proj", m.down_proj, rows_of=m.gate_up_proj, rows=m.gate_up_proj.shard_slice(1))]
    return sites


class InputStats:
    """H = 2/n XᵀX and mean|x| per input channel over every row fed to a linear; with `keep_every`,
    also every keep_every-th row itself (`rows`)."""

    def __init__(self, in_features: int, device, keep_every: int = 0):
        self.hessian = HessianAccumulator(in_features, device)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64, device=device)
        self.keep_every, self.seen, self.kept = keep_every, 0, []

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [N, in]
        self.hessian.add(x)
        self.abs_sum += x.abs().sum(dim=0, dtype=torch.float64)
        if self.keep_every:
            first = -self.seen % self.keep_every  # the stride runs on across chunks
            self.kept.append(x[first::self.keep_every].clone())
            self.seen += x.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        return torch.cat(self.kept)

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.hessian.count)).float()


def weight_magnitude(W: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over output channels of |w| / max |w| of its group, per input channel [in]."""
    out_f, in_f = W.shape
    gs = group_width(in_f, group_size)
    groups = -(-in_f // gs)
    w = F.pad(W.abs(), (0, groups * gs - in_f)).view(out_f, groups, gs)  # a partial last group padded with 0
    w = w / (w.amax(dim=2, keepdim=True) + 1e-6)
    return w.view(out_f, groups * gs)[:, :in_f].mean(dim=0)


def scaled_rounding(W: torch.Tensor, s: torch.Tensor, H: torch.Tensor, spec: GridSpec, group_size: int) -> torch.Tensor:
    """Q(W diag(s)), dequantized: on the output grid, each group's clipping range scored on the
    scaled input's Hessian diag(s)⁻¹ H diag(s)⁻¹ (H: the unscaled input's); else on min/max."""
    Ws = W * s
    if spec.grid != "output":
        return fake_quantize(Ws, spec, group_size)
    Hs = H / s.unsqueeze(0) / s.unsqueeze(1)
    return rtn_quantize(Ws, spec, group_size, output_clip_params(Ws, Hs, spec, group_size)).dequantize()


def output_error(W: torch.Tensor, s: torch.Tensor, H: torch.Tensor, spec: GridSpec, group_size: int) -> float:
    """Σ over outputs of ΔW H ΔWᵀ for ΔW = Q(W diag(s)) diag(s)⁻¹ − W."""
    delta = scaled_rounding(W, s, H, spec, group_size).div_(s).sub_(W)  # [out, in]
    return float((delta @ H).mul_(delta).sum())


def mlp_output_error(W: torch.Tensor, s: torch.Tensor, X: torch.Tensor, down: torch.Tensor, ref: torch.Tensor,
                     H: torch.Tensor, spec: GridSpec, group_size: int, act=silu_mul) -> float:
    """‖down(silu(gate')·up') − ref‖² over the rows of X [T, in], gate'/up' from the merged gate/up
    weight W [2I, in] rounded as Q(W diag(s)) diag(s)⁻¹ (H: the Hessian of all its inputs, for the
    output grid); `down` [hidden, I] stays float."""
    Wq = scaled_rounding(W, s, H, spec, group_size).div_(s)
    return float(((act(X @ Wq.T) @ down.T) - ref).pow_(2).sum())


def search_scale(W: torch.Tensor, stats: InputStats, spec: GridSpec, group_size: int,
                 down: torch.Tensor | None = None, act=silu_mul) -> tuple[torch.Tensor, float]:
    """The s of least output error for W [out, in] (see the module docstring), and its α (-1: s = 1).
    With `down` (the MLP's down_proj weight), W is the merged gate/up, scored at the MLP's output on
    stats.rows (`act`: the MLP's activation of [gate | up], silu's or Gemma's gelu); else by its own output
    error."""
    W = W.float()
    x_mean, w_mean = stats.abs_mean.to(W.device), weight_magnitude(W, group_size)
    H = stats.hessian.hessian()
    if down is None:
        W = W[::-(-W.shape[0] // SEARCH_ROWS)]  # every k-th output channel: the error sum, estimated at a fraction

        def error(s):
            return output_error(W, s, H, spec, group_size)
    else:
        X, down = stats.rows, down.float()
        ref = act(X @ W.T) @ down.T  # [T, hidden]: the float MLP

        def error(s):
            return mlp_output_error(W, s, X, down, ref, H, spec, group_size, act)
    best_s, best_alpha = torch.ones_like(x_mean), -1.0
    best_err = error(best_s)
    for i in range(GRID):
        alpha = i / GRID
        s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=S_MIN)).clamp(min=S_MIN)
        s = s / (s.max() * s.min()).sqrt()
        err = error(s)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha


@torch.no_grad()
def apply_scale(site: ScaleSite, s: torch.Tensor) -> None:
    """W <- W diag(s), the op before it <- itself / s; the layer's float outputs are unchanged."""
    if site.norm is not None:
        off = site.norm.offset  # Gemma's norm multiplies by 1 + weight
        old = site.norm.scale().float()
        held = (old / s - off).half().float()  # what the checkpoint will hold
        new = held + off
        s = torch.where(new != 0, old / new, s)
        site.norm.weight.copy_(held)
    else:
        prev = site.rows_of
        prev.weight[site.rows] /= s.unsqueeze(1)
        if prev.bias is not None:
            prev.bias[site.rows] /= s
    site.linear.weight.mul_(s.unsqueeze(0))


def scale_layer(layer: DecoderLayer, acts: CalibrationActivations,
                config_of: Callable[[nn.Module], tuple[int, int, bool] | None], grid: str = "minmax") -> dict[str, float]:
    """Search and fold AWQ scales into every site of `layer`. `config_of(linear)` -> (bits, group
    size, sym) of its quantization, or None if it stays float; `grid` the one it will be rounded on.
    Returns the α chosen per site (-1: left unscaled).

    Every site's input statistics come from one pass of the float layer before any scaling: the
    scales of one site leave the float outputs of the others, hence their inputs, unchanged."""
    sites = [s for s in scale_sites(layer) if config_of(s.linear) is not None]
    gate_up = layer.mlp.gate_up_proj
    keep_every = max(1, acts.num_tokens // MLP_TOKENS)
    stats = {s.linear: InputStats(s.linear.in_features, s.linear.weight.device,
                                  keep_every if s.linear is gate_up else 0) for s in sites}
    for mod, inputs in acts.linear_inputs(layer, advance=False):
        if mod in stats:
            for x in inputs:
                stats[mod].add(x)
    chosen = {}
    for site in sites:
        bits, group_size, sym = config_of(site.linear)
        down = layer.mlp.down_proj.weight if site.linear is gate_up else None
        act = silu_mul if layer.mlp.act == "silu" else gelu_tanh_mul
        s, alpha = search_scale(site.linear.weight, stats.pop(site.linear), GridSpec(bits, sym, grid), group_size,
                                down, act)
        if alpha >= 0:
            apply_scale(site, s)
        chosen[site.name] = alpha
    return chosen
