"""Quantize the linears of one decoder layer in place, and name its tensors for the checkpoint.

GPTQ is true-sequential: the linears are quantized in the order the layer's forward calls them
(qkv, then o_proj, then gate/up, then down), and each one's Hessian comes from inputs computed by
the already-quantized linears before it. After quantization the layer's fp32 weights are replaced
by their dequantized values, so the layer's outputs feed the next layer exactly as a reader of the
checkpoint would compute them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flotilla.models.checkpoint import gptq_tensors
from flotilla.models.linear import Linear
from flotilla.models.llama import DecoderLayer
from flotilla.models.weights import layer_plan

from .activations import CalibrationActivations
from .gptq import HessianAccumulator, gptq_quantize
from .grid import GridSpec, QuantizedWeight, rtn_quantize
from .options import QuantizeOptions


@dataclass
class LayerResult:
    weights: dict[nn.Module, QuantizedWeight]  # per (merged) linear module
    damp_raised: int = 0  # linears whose damping had to be raised


def quantize_layer(layer: DecoderLayer, options: QuantizeOptions,
                   acts: CalibrationActivations | None) -> LayerResult:
    """Quantize every linear of `layer` (GPTQ needs `acts`; RTN ignores it)."""
    spec = GridSpec(options.bits, options.sym, clip=options.grid == "mse")
    linears = [m for m in layer.modules() if isinstance(m, Linear)]
    result = LayerResult({})
    if options.method == "gptq":
        if acts is None:
            raise ValueError("GPTQ needs calibration activations")
        linears = acts.call_order(layer, linears)
    for mod in linears:
        if options.method == "rtn":
            q = rtn_quantize(mod.weight, spec, options.group_size)
        else:
            acc = HessianAccumulator(mod.in_features, mod.weight.device)
            acts.feed(layer, mod, acc.add)
            g = gptq_quantize(mod.weight, acc.hessian(), spec, options.group_size, options.damp_percent,
                              options.block_size, options.act_order)
            q = g.weight
            result.damp_raised += g.damp_percent > options.damp_percent
        with torch.no_grad():
            mod.weight.copy_(q.dequantize())
        result.weights[mod] = q
    return result


def layer_tensors(layer: DecoderLayer, index: int, weights: dict[nn.Module, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a quantized layer, under the per-projection names of Hugging
    Face / GPTQ checkpoints (a merged qkv_proj becomes q_proj, k_proj and v_proj)."""
    tensors: dict[str, torch.Tensor] = {}
    for item in layer_plan(layer, index):
        mod = item.module
        if isinstance(mod, Linear):
            rows = mod.shard_slice(item.shard)
            if item.suffix == "weight":
                tensors.update(gptq_tensors(item.source_name.rsplit(".", 1)[0], weights[mod].to_gptq(rows)))
            else:
                tensors[item.source_name] = getattr(mod, item.suffix)[rows].to(torch.float16)
        else:
            tensors[item.source_name] = getattr(mod, item.suffix).to(torch.float16)
    return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
