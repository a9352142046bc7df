"""Mixed precision: which linears stay at 8 bits (or in fp16), written the way GPTQ tools write it.

The unit of choice is one linear of the runtime: q/k/v are merged into one, gate/up into one, so
they share their bits. `--keep BITS:PATTERN` picks units whose checkpoint projection names
(`model.layers.3.self_attn.q_proj`) `re.match` PATTERN; a pattern that matches some projections of
a merged unit but not the others is refused. `--sensitive N` picks the N units whose INT4
quantization (the base settings, round-to-nearest on the chosen grid) perturbs the residual stream
most, relative to the stream itself, on the calibration activations of the float model:

    o_proj, down_proj:     err = ‖X ΔWᵀ‖² / ‖h‖²          (what they add to the stream, exactly)
    qkv_proj, gate_up_proj: err = ‖X ΔWᵀ‖² / ‖X Wᵀ‖² · ‖Y‖² / ‖h‖²

with ‖X ΔWᵀ‖² = tr(ΔW H ΔWᵀ), H = XᵀX, h the residual stream after the unit's layer and Y its
block's output (o_proj's for qkv_proj, down_proj's for gate_up_proj): their relative error,
assumed carried to what the block adds. The unit's own relative error alone ranks alike linears
alike whatever their layer does; on SmolLM2-135M the layers that change the stream most for its
size (0-2, the one that makes its massive activation, 11, and the last two) are the ones whose
rounding costs the most perplexity alone (+3-6% each at g128, against +1% for a middle layer),
and this measure picks them.

The choice goes into `quantization_config.dynamic` (GPTQModel's per-module overrides, which vLLM
reads too), one entry per unit, with a pattern that matches both the checkpoint's projection names
(GPTQModel) and a merged name (vLLM matches `qkv_proj` / `gate_up_proj`):

    "+:model\\.layers\\.3\\.self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)$": {"bits": 8}
    "-:model\\.layers\\.0\\.mlp\\.(?:down_proj)$": {}          (16: left unquantized)
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig
from flotilla.models.linear import Linear
from flotilla.models.llama import MLP, Attention
from flotilla.models.weights import load_layer
from flotilla.progress import progress_bar

from .activations import CalibrationActivations
from .gptq import HessianAccumulator
from .clip import output_clip_params
from .grid import GridSpec, rtn_quantize
from .options import QuantizeOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One runtime linear: checkpoint projections `prefix + p` for p in projections."""

    layer: int
    prefix: str  # model.layers.3.self_attn.
    projections: tuple[str, ...]
    merged: str  # the runtime's name: qkv_proj, o_proj, gate_up_proj, down_proj
    weights: int  # in * out

    @property
    def names(self) -> list[str]:
        return [self.prefix + p for p in self.projections]

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.merged}"

    def pattern(self) -> str:
        alternatives = list(self.projections) + ([self.merged] if self.merged not in self.projections else [])
        return f"{re.escape(self.prefix)}(?:{'|'.join(alternatives)})$"


def units(cfg: ModelConfig) -> list[Unit]:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    out = []
    for n in range(cfg.num_hidden_layers):
        attn, mlp = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        out += [Unit(n, attn, Attention.MERGED["qkv_proj"], "qkv_proj", h * (q + 2 * kv)),
                Unit(n, attn, ("o_proj",), "o_proj", q * h),
                Unit(n, mlp, MLP.MERGED["gate_up_proj"], "gate_up_proj", h * 2 * i),
                Unit(n, mlp, ("down_proj",), "down_proj", i * h)]
    return out


def keep_choice(cfg: ModelConfig, keep: tuple[tuple[int, str], ...]) -> dict[Unit, int]:
    """The units each --keep pattern picks (the first pattern that matches a unit wins)."""
    chosen: dict[Unit, int] = {}
    for bits, pattern in keep:
        hits = 0
        for unit in units(cfg):
            matches = [re.search(pattern, name) is not None for name in unit.names]  # anywhere in the name, as grep
            if any(matches) and not all(matches):
                names = ", ".join(p for p, m in zip(unit.projections, matches) if m)
                rest = ", ".join(p for p, m in zip(unit.projections, matches) if not m)
                raise FlotillaError(f"--keep {bits}:{pattern} matches {names} but not {rest} of layer {unit.layer}: "
                                    f"they are one merged linear ({unit.merged}) and must share their bits")
            if all(matches):
                hits += 1
                chosen.setdefault(unit, bits)
        if not hits:
            raise FlotillaError(f"--keep {bits}:{pattern} matches no linear; names look like "
                                "model.layers.0.self_attn.q_proj or model.layers.0.mlp.down_proj")
    return chosen


def dynamic_entries(chosen: dict[Unit, int]) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """`quantization_config.dynamic` for the chosen units, in model order."""
    entries = []
    for unit in sorted(chosen, key=lambda u: (u.layer, u.prefix, u.merged)):
        bits = chosen[unit]
        entries.append((f"-:{unit.pattern()}", ()) if bits == 16 else (f"+:{unit.pattern()}", (("bits", bits),)))
    return tuple(entries)


@torch.no_grad()
def measure_errors(source, cfg: ModelConfig, acts: CalibrationActivations, options: QuantizeOptions,
                   progress: bool = True) -> dict[Unit, float]:
    """Each unit's share of the residual stream that its INT4 rounding (the base settings) perturbs
    (module docstring), layer by layer through the float model. Consumes `acts` (advances it past
    the last layer)."""
    spec = GridSpec(options.bits, options.sym, grid=options.grid)
    by_name = {(u.layer, u.merged): u for u in units(cfg)}
    errors: dict[Unit, float] = {}
    device = acts.hidden.device
    for i in progress_bar(range(cfg.num_hidden_layers), desc="measure sensitivity", unit="layer", disable=not progress):
        layer = load_layer(source, i, device, torch.float32)
        merged = {mod: name.rsplit(".", 1)[-1] for name, mod in layer.named_modules() if isinstance(mod, Linear)}
        energy = {}  # merged name -> (E‖ΔW x‖², E‖W x‖²), both over 2/n
        for mod, inputs in acts.linear_inputs(layer, advance=True):
            acc = HessianAccumulator(mod.in_features, device)
            for x in inputs:
                acc.add(x)
            H, W = acc.hessian(), mod.weight.float()
            params = output_clip_params(W, H, spec, options.group_size) if spec.grid == "output" else None
            delta = rtn_quantize(W, spec, options.group_size, params).dequantize().sub_(W)
            energy[merged[mod]] = (float(((delta @ H) * delta).sum()), float(((W @ H) * W).sum()))
        residual = 2 * float(acts.hidden.pow(2).sum(dim=-1).mean())  # E‖h‖² of the layer's output, over 2/n
        for name, (err, out) in energy.items():
            if name in ("qkv_proj", "gate_up_proj"):  # its relative error, carried to its block's output
                block = energy["o_proj" if name == "qkv_proj" else "down_proj"][1]
                err = err / max(out, 1e-30) * block
            errors[by_name[(i, name)]] = err / max(residual, 1e-30)
        del layer
        source.release()
    return errors


def most_sensitive(errors: dict[Unit, float], n: int, taken: dict[Unit, int]) -> list[Unit]:
    """The n units of largest error that --keep has not already placed."""
    ranked = sorted((u for u in errors if u not in taken), key=lambda u: errors[u], reverse=True)
    if n > len(ranked):
        raise FlotillaError(f"--sensitive {n}: the model has only {len(ranked)} linears left to choose from")
    return ranked[:n]
