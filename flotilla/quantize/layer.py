"""Quantize the linears of one decoder layer in place, and name its tensors for the checkpoint.

Each linear gets its own settings from the checkpoint's QuantConfig (`for_module` of its
projection names: mixed precision writes per-module `dynamic` overrides), or stays float.

GPTQ is true-sequential: the linears are quantized in the order the layer's forward calls them
(qkv, then o_proj, then gate/up, then down), and each one's Hessian comes from inputs computed by
the already-quantized linears before it. AWQ (flotilla.quantize.awq) first scales the float layer
(its outputs unchanged), then RTN or GPTQ quantizes the scaled weights. After quantization the
layer's fp32 weights are replaced by their dequantized values, so the layer's outputs feed the next
layer exactly as a reader of the checkpoint would compute them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from flotilla.models.checkpoint import gptq_tensors
from flotilla.models.config import QuantConfig
from flotilla.models.linear import Linear
from flotilla.models.llama import DecoderLayer
from flotilla.models.weights import layer_plan

from .activations import CalibrationActivations
from .awq import scale_layer
from .gptq import HessianAccumulator, gptq_quantize
from .clip import output_clip_params
from .grid import GridSpec, QuantizedWeight, rtn_quantize
from .options import QuantizeOptions


@dataclass
class LayerResult:
    weights: dict[nn.Module, QuantizedWeight]  # per quantized (merged) linear module
    damp_raised: int = 0  # linears whose damping had to be raised
    awq_alpha: dict[str, float] = field(default_factory=dict)  # AWQ's α per scaled site (-1: unscaled)


def projection_names(layer: DecoderLayer, index: int) -> dict[nn.Module, list[str]]:
    """The checkpoint projections (`model.layers.3.self_attn.q_proj`, …) each linear is made of."""
    names: dict[nn.Module, list[str]] = {}
    for item in layer_plan(layer, index):
        if isinstance(item.module, Linear) and item.suffix == "weight":
            names.setdefault(item.module, []).append(item.source_name.rsplit(".", 1)[0])
    return names


def quantize_layer(layer: DecoderLayer, index: int, options: QuantizeOptions, quant: QuantConfig,
                   acts: CalibrationActivations | None, advance: bool = False,
                   fp_acts: CalibrationActivations | None = None) -> LayerResult:
    """Quantize every linear of `layer` (GPTQ and AWQ need `acts`; RTN ignores it). With
    `advance`, `acts` ends holding the quantized layer's outputs (the next layer's inputs), and
    `fp_acts` (--fp-targets: the float model's hidden states) the float layer's."""
    configs = {mod: quant.for_module(names) for mod, names in projection_names(layer, index).items()}
    result = LayerResult({})
    if options.uses_activations and acts is None:
        raise ValueError(f"--method {options.method} needs calibration activations")
    if options.method in ("awq", "awq+gptq"):
        result.awq_alpha = scale_layer(layer, acts, lambda m: _triple(configs[m]), options.grid)
    rounding = options.method in ("rtn", "awq")
    if acts is None or (rounding and options.grid != "output" and not advance):
        stages = ((m, iter(())) for m in configs)  # rounding alone: no inputs to run
    else:
        stages = acts.linear_inputs(layer, advance)  # true-sequential: each linear's inputs through the ones before
    # the float layer (after AWQ's scales: the same bases) over the float model's hidden states, in step
    fp_stages = fp_acts.linear_inputs(copy.deepcopy(layer), advance) if fp_acts is not None else None
    for mod, inputs in stages:
        fp_inputs = next(fp_stages)[1] if fp_stages is not None else None
        cfg = configs[mod]
        if cfg is None:
            continue  # kept in float (a "-:" dynamic pattern)
        spec = GridSpec(cfg.bits, cfg.sym, grid=options.grid)
        if rounding and spec.grid != "output":
            q = rtn_quantize(mod.weight, spec, cfg.group_size)
            result.weights[mod] = _write_back(mod, q)
            continue
        acc = HessianAccumulator(mod.in_features, mod.weight.device, cross=fp_inputs is not None)
        for x, x_fp in zip(inputs, fp_inputs) if fp_inputs is not None else ((x, None) for x in inputs):
            acc.add(x, x_fp)
        if rounding:
            params = output_clip_params(mod.weight, acc.hessian(), spec, cfg.group_size)
            q = rtn_quantize(mod.weight, spec, cfg.group_size, params)
        else:
            target = acc.fp_target(mod.weight, options.damp_percent) if fp_inputs is not None else mod.weight
            g = gptq_quantize(target, acc.hessian(), spec, cfg.group_size, options.damp_percent,
                              options.block_size, options.act_order)
            q = g.weight
            result.damp_raised += g.damp_percent > options.damp_percent
        result.weights[mod] = _write_back(mod, q)
    for _ in fp_stages or ():  # the float stream's last stage (its layer output, with `advance`)
        pass
    return result


def _write_back(mod: nn.Module, q: QuantizedWeight) -> QuantizedWeight:
    """The linear's weights become what a reader of the checkpoint decodes (the stages after it,
    and the next layer, compute through them)."""
    with torch.no_grad():
        mod.weight.copy_(q.dequantize())
    return q


def _triple(cfg: QuantConfig | None) -> tuple[int, int, bool] | None:
    return None if cfg is None else (cfg.bits, cfg.group_size, cfg.sym)


def layer_tensors(layer: DecoderLayer, index: int, weights: dict[nn.Module, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a quantized layer, under the per-projection names of Hugging
    Face / GPTQ checkpoints (a merged qkv_proj becomes q_proj, k_proj and v_proj). A linear left
    in float is written as its fp16 `weight`."""
    tensors: dict[str, torch.Tensor] = {}
    for item in layer_plan(layer, index):
        mod = item.module
        if isinstance(mod, Linear):
            rows = mod.shard_slice(item.shard)
            if item.suffix == "weight" and mod in weights:
                tensors.update(gptq_tensors(item.source_name.rsplit(".", 1)[0], weights[mod].to_gptq(rows)))
            else:
                tensors[item.source_name] = getattr(mod, item.suffix)[rows].to(torch.float16)
        else:
            tensors[item.source_name] = getattr(mod, item.suffix).to(torch.float16)
    return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
