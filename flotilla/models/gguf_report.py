"""What a natively loaded GGUF model runs each of its tensor types in, said once at load.

    GGUF Q4_1: 210 tensors -> cpu Q4_1 ...; Q8_0: 1 tensor -> ...; F32: 61 tensors -> fp32 as stored
    warning: GGUF type IQ4_NL (1 tensor: model.embed_tokens.weight) has no flotilla kernel; ...
"""
from __future__ import annotations

from dataclasses import dataclass

from flotilla.kernels.ggml import GGML_FORMATS

from .gguf_source import GGUF_DENSE_TYPES, GGUFSource
from .llama import CausalLM


@dataclass(frozen=True)
class TypeUse:
    """The tensors of one GGUF type in a loaded stage and the forms they run in."""

    qtype: str
    tensors: tuple[str, ...]
    forms: tuple[str, ...]

    def describe(self) -> str:
        n = len(self.tensors)
        return f"{self.qtype}: {n} tensor{'s' if n != 1 else ''} -> {', '.join(self.forms)}"


def type_uses(source: GGUFSource, model: CausalLM) -> list[TypeUse]:
    from .weights import load_plan

    names: dict[str, list[str]] = {}
    forms: dict[str, dict[str, None]] = {}
    for item in load_plan(model):
        qtype = source.type_of(item.source_name)
        names.setdefault(qtype, []).append(item.source_name)
        part_form = getattr(item.module, "part_form", None)
        form = part_form(item.shard) if part_form is not None and item.suffix == "weight" else "fp32 as stored"
        forms.setdefault(qtype, {})[form] = None
    return [TypeUse(q, tuple(names[q]), tuple(forms[q])) for q in sorted(names)]


def fallback_warning(use: TypeUse, bits_per_weight: float) -> str:
    """The warning for a type that runs dequantized to fp32, with what it costs."""
    n = len(use.tensors)
    which = use.tensors[0] + (f" and {n - 1} more" if n > 1 else "")
    return (f"warning: GGUF type {use.qtype} ({which}) has no flotilla kernel; it runs dequantized to fp32, "
            f"{32 / bits_per_weight:.1f}x the {bits_per_weight:.2g} bits a weight of the file, so every step reads "
            f"that much more memory for those tensors (slower decode); a file of "
            f"{', '.join(GGML_FORMATS)} tensors runs natively")


def load_report(source: GGUFSource, model: CausalLM) -> list[str]:
    """One line of types and forms, then one warning per type on the fp32 path."""
    import gguf

    uses = type_uses(source, model)
    lines = [f"GGUF {source.path.name}: " + "; ".join(u.describe() for u in uses)]
    for use in uses:
        if use.qtype in GGML_FORMATS or use.qtype in GGUF_DENSE_TYPES:
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[use.qtype]]
        lines.append(fallback_warning(use, size * 8 / block))
    return lines
