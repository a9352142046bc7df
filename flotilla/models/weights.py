"""Build one stage of a model and fill it from a weight source, reading only its tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import default_g_idx

from .config import ModelConfig
from .linear import Linear, QuantLinear
from .llama import CausalLM, RMSNorm, Stage

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class LoadItem:
    """One checkpoint tensor and where it goes: a shard of a linear, or a plain parameter."""

    source_name: str
    module: nn.Module
    suffix: str  # attribute of `module` (weight, bias, qweight, …)
    shard: int = -1  # >= 0 for a (merged) linear's output slice


def load_plan(model: CausalLM) -> list[LoadItem]:
    """Every checkpoint tensor this stage needs, with its destination."""
    cfg, plan = model.config, []
    for name, mod in model.named_modules():
        if isinstance(mod, (Linear, QuantLinear)):
            parent_name, leaf = name.rsplit(".", 1)
            merged = getattr(model.get_submodule(parent_name), "MERGED", {}).get(leaf, (leaf,))
            for shard, proj in enumerate(merged):
                for suffix in mod.tensor_suffixes():
                    plan.append(LoadItem(f"{parent_name}.{proj}.{suffix}", mod, suffix, shard))
        elif name == "lm_head":
            if cfg.tie_word_embeddings and model.stage.is_first:
                continue  # the same Parameter as the embedding
            plan.append(LoadItem(EMBED if cfg.tie_word_embeddings else HEAD, mod, "weight"))
        elif isinstance(mod, (nn.Embedding, RMSNorm)):
            plan.append(LoadItem(f"{name}.weight", mod, "weight"))
    return plan


def build_stage(config: ModelConfig, stage: Stage | None, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """An uninitialised stage on `device` (no random init: tensors are filled by the loader)."""
    with torch.device("meta"):
        model = CausalLM(config, stage)
    model.to_empty(device=device)
    model.tie_weights()
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def load_stage(source, stage: Stage | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = False) -> CausalLM:
    """Load the layers of `stage` (default: all) from `source`; only their tensors are read."""
    model = build_stage(source.config, stage, device, dtype)
    available = set(source.names())
    plan = load_plan(model)
    with torch.no_grad():
        for item in tqdm(plan, desc="loading", unit="tensor", disable=not progress, leave=False):
            if item.source_name not in available:
                if item.suffix == "g_idx":  # older GPTQ files omit g_idx when desc_act is off
                    item.module.load("g_idx", item.shard, default_g_idx(item.module.in_features, item.module.group_size))
                    continue
                raise FlotillaError(f"{source.path}: tensor {item.source_name!r} is missing")
            value = source.get(item.source_name)
            try:
                if item.shard >= 0:
                    item.module.load(item.suffix, item.shard, value)
                else:
                    target = getattr(item.module, item.suffix)
                    if tuple(target.shape) != tuple(value.shape):
                        raise FlotillaError(f"shape {tuple(value.shape)} where {tuple(target.shape)} was expected")
                    target.copy_(value.to(target.dtype))
            except FlotillaError as e:
                raise FlotillaError(f"{source.path}: tensor {item.source_name!r}: {e}") from None
    model.build_rope()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.prepare(dtype)
    return model
