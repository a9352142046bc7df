"""Build one stage of a model and fill it from a weight source, reading only its tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flotilla.errors import FlotillaError
from flotilla.progress import progress_bar

from .config import ModelConfig
from .gguf_linear import GGUFEmbedding, GGUFLinear, GGUFLMHead
from .linear import Linear, QuantLinear
from .llama import CausalLM, DecoderLayer, NormMatrix, RMSNorm, Stage
from .parallel import VocabParallel

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
NORM_MATRIX = "model.norm_matrix.weight"  # quantize --rotate-tied-head (llama.NormMatrix)


@dataclass(frozen=True)
class LoadItem:
    """One checkpoint tensor and where it goes: a shard of a linear, or a plain parameter."""

    source_name: str
    module: nn.Module
    suffix: str  # attribute of `module` (weight, bias, qweight, …)
    shard: int = -1  # >= 0 for a (merged) linear's output slice


def _linear_items(root: nn.Module, name: str, mod: nn.Module, prefix: str = "") -> list[LoadItem]:
    """The checkpoint tensors of the (possibly merged) linear `name` of `root`."""
    parent_name, leaf = name.rsplit(".", 1)
    merged = getattr(root.get_submodule(parent_name), "MERGED", {}).get(leaf, (leaf,))
    return [LoadItem(f"{prefix}{parent_name}.{proj}.{suffix}", mod, suffix, shard)
            for shard, proj in enumerate(merged) for suffix in mod.tensor_suffixes()]


LINEARS = (Linear, QuantLinear, GGUFLinear)
GGUF_TABLES = (GGUFEmbedding, GGUFLMHead)


def _whole(mod: nn.Module) -> int:
    """Shard 0 (loaded through the module's `load`) for a tensor-parallel vocabulary share, which
    slices it, and a GGUF table, which keeps its blocks; -1 (copied as it is) otherwise."""
    return 0 if isinstance(mod, (VocabParallel, *GGUF_TABLES)) else -1


def load_plan(model: CausalLM) -> list[LoadItem]:
    """Every checkpoint tensor this stage needs, with its destination."""
    cfg, plan = model.config, []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear) and name == "lm_head":  # stored on its own, tied or not
            plan.extend(LoadItem(f"lm_head.{suffix}", mod, suffix, 0) for suffix in mod.tensor_suffixes())
        elif isinstance(mod, LINEARS):
            plan.extend(_linear_items(model, name, mod))
        elif name == "lm_head":
            if cfg.tie_word_embeddings and model.stage.is_first:
                continue  # the same Parameter as the embedding
            plan.append(LoadItem(EMBED if cfg.tie_word_embeddings else HEAD, mod, "weight", _whole(mod)))
        elif isinstance(mod, (nn.Embedding, GGUFEmbedding, RMSNorm, NormMatrix)):
            plan.append(LoadItem(f"{name}.weight", mod, "weight", _whole(mod)))
    return plan


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def layer_plan(layer: DecoderLayer, index: int) -> list[LoadItem]:
    """Every checkpoint tensor of decoder layer `index`, with its destination in `layer`."""
    prefix, plan = layer_prefix(index), []
    for name, mod in layer.named_modules():
        if isinstance(mod, LINEARS):
            plan.extend(_linear_items(layer, name, mod, prefix))
        elif isinstance(mod, RMSNorm):
            plan.append(LoadItem(f"{prefix}{name}.weight", mod, "weight"))
    return plan


def required_tensor_names(config: ModelConfig) -> list[str]:
    """The names a source must hold for the whole model described by `config`."""
    with torch.device("meta"):
        model = CausalLM(config)
    return [item.source_name for item in load_plan(model)]


def _materialize(module: nn.Module, device, dtype: torch.dtype) -> None:
    """Give a meta-built module uninitialised storage on `device`, floating parameters in `dtype`
    (allocated in that dtype directly, so no full-size fp32 copy is ever made; and not through
    Module.to_empty, whose meta-tensor path imports sympy: ~36 MB of a CPU process)."""
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                dt = dtype if p.is_floating_point() else p.dtype
                mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device),
                                                     requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def build_stage(config: ModelConfig, stage: Stage | None, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """An uninitialised stage on `device` (no random init: tensors are filled by the loader)."""
    with torch.device("meta"):
        model = CausalLM(config, stage)
    _materialize(model, device, dtype)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def build_layer(config: ModelConfig, index: int, device: torch.device | str, dtype: torch.dtype) -> DecoderLayer:
    """One uninitialised decoder layer on `device`."""
    with torch.device("meta"):
        layer = DecoderLayer(config, index)
    _materialize(layer, device, dtype)
    return layer.eval().requires_grad_(False)


def load_stage(source, stage: Stage | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = False, keep_source: bool = False) -> CausalLM:
    """Load the layers of `stage` (default: all) from `source`; only their tensors are read. The
    quantized linears keep their GPTQ tensors beside their kernels only with `keep_source`
    (QuantLinear.prepare)."""
    model = build_stage(source.config, stage, device, dtype)
    _fill(source, load_plan(model), progress, finish=_gguf_finisher(dtype, device))
    model.build_rope()
    _prepare_quant(model, dtype, device, keep_source)
    return model


def load_layer(source, index: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DecoderLayer:
    """Load decoder layer `index` alone (only its tensors are read). The caller supplies rope and
    attention when running it, as CausalLM does."""
    layer = build_layer(source.config, index, device, dtype)
    _fill(source, layer_plan(layer, index), finish=_gguf_finisher(dtype, device))
    _prepare_quant(layer, dtype, device)
    return layer


def _fill(source, plan: list[LoadItem], progress: bool = False, finish=None) -> None:
    """Copy every item's tensor into place. `finish(module)` is called for each module once its
    last item is in (the plan lists a module's items together)."""
    available = set(source.names())
    read = getattr(source, "get_native", source.get)  # a GGUF source hands its blocks to the GGUF layers
    with torch.no_grad():
        for i, item in enumerate(progress_bar(plan, desc="loading", unit="tensor", disable=not progress, leave=False)):
            if finish is not None and i and plan[i - 1].module is not item.module:
                finish(plan[i - 1].module)
            if item.source_name not in available:
                if item.suffix == "g_idx":  # older GPTQ files omit g_idx when desc_act is off
                    item.module.load("g_idx", item.shard, item.module.missing_g_idx())
                    continue
                raise FlotillaError(f"{source.path}: tensor {item.source_name!r} is missing")
            value = read(item.source_name)
            try:
                if item.shard >= 0:
                    item.module.load(item.suffix, item.shard, value)
                else:
                    target = getattr(item.module, item.suffix)
                    if tuple(target.shape) != tuple(value.shape):
                        raise FlotillaError(f"shape {tuple(value.shape)} where {tuple(target.shape)} was expected")
                    _check_range(value, target.dtype)
                    target.copy_(value.to(target.dtype))
            except FlotillaError as e:
                raise FlotillaError(f"{source.path}: tensor {item.source_name!r}: {e}") from None
        if finish is not None and plan:
            finish(plan[-1].module)


def _check_range(value: torch.Tensor, dtype: torch.dtype) -> None:
    """A wider float tensor going into fp16 must fit it: past 65504 it would become inf, and the logits NaN."""
    if dtype == torch.float16 and value.dtype in (torch.bfloat16, torch.float32) and value.numel():
        low, high = torch.aminmax(value)  # no |value| copy of a large tensor
        top = max(-float(low), float(high))
        if top > torch.finfo(torch.float16).max:
            raise FlotillaError(f"values up to {top:.4g} in {str(value.dtype)[6:]}, beyond fp16's range (65504): "
                                "run it in bfloat16 or float32 (--dtype bfloat16 or --dtype float32)")


def _gguf_finisher(dtype: torch.dtype, device: torch.device | str):
    """Pack each GGUF module as soon as it is loaded, so that a load holds one tensor's decoded
    blocks at a time, not the whole model's."""
    def finish(module: nn.Module) -> None:
        if isinstance(module, (GGUFLinear, *GGUF_TABLES)):
            module.prepare(dtype, device)
    return finish


def _prepare_quant(module: nn.Module, dtype: torch.dtype, device: torch.device | str,
                   keep_source: bool = False) -> None:
    for mod in module.modules():
        if isinstance(mod, QuantLinear):
            mod.prepare(dtype, keep_source)
        elif isinstance(mod, (GGUFLinear, *GGUF_TABLES)) and not mod.prepared:
            mod.prepare(dtype, device)
