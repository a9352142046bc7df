"""A SmolLM2 INT4 checkpoint for tests and benchmarks, made here until `quantize` exists.

Round-to-nearest, symmetric, 4 bits, groups of 32 along the input axis, written in the GPTQ
layout through the one checkpoint module (CheckpointWriter), so the runtime loads it exactly as
it loads a `quantize` output. Cached on disk (keyed by the GGUF file and this recipe), so the
few seconds it takes are paid once per machine.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from flotilla.envs import cache_dir
from flotilla.kernels.gptq import GPTQWeight, default_g_idx
from flotilla.models.checkpoint import TOKENIZER_FILES, CheckpointWriter, is_checkpoint
from flotilla.models.config import QuantConfig
from flotilla.models.sources import open_source
from flotilla.models.tokenizer import load_tokenizer

RECIPE = "rtn-sym-int4-g32-v1"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def rtn_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 32) -> GPTQWeight:
    """weight [out, in] (as nn.Linear keeps it) -> GPTQ tensors; symmetric (zero = 2**(bits-1))."""
    w = weight.t().float()  # [in, out]
    n_in, n_out = w.shape
    groups = w.view(n_in // group_size, group_size, n_out)  # [G, gs, out]
    qmax = 2 ** (bits - 1) - 1
    scales = (groups.abs().amax(dim=1) / qmax).clamp(min=1e-8)  # [G, out]
    scales = scales.half().float()  # the stored precision, so codes are rounded against it
    zero = 2 ** (bits - 1)
    q = (groups / scales[:, None, :]).round().clamp(-zero, qmax) + zero  # [G, gs, out] in [0, 2**bits)
    zeros = torch.full((n_in // group_size, n_out), zero, dtype=torch.int32)
    return GPTQWeight.from_codes(q.view(n_in, n_out).to(torch.int32), zeros, scales,
                                 default_g_idx(n_in, group_size), bits, group_size)


def build_int4_checkpoint(gguf: Path, out: Path, group_size: int = 32) -> Path:
    source = open_source(gguf)
    cfg = source.config.with_quant(QuantConfig(bits=4, group_size=group_size, sym=True, method="rtn"))
    with CheckpointWriter(out, cfg, force=True) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": source.get("model.embed_tokens.weight")})
        for i in range(cfg.num_hidden_layers):
            tensors = {}
            for proj in PROJECTIONS:
                gw = rtn_quantize(source.get(f"model.layers.{i}.{proj}.weight"), 4, group_size)
                for suffix in ("qweight", "qzeros", "scales", "g_idx"):
                    tensors[f"model.layers.{i}.{proj}.{suffix}"] = getattr(gw, suffix)
            for norm in NORMS:
                name = f"model.layers.{i}.{norm}.weight"
                tensors[name] = source.get(name)
            w.add_layer(str(i), tensors)
        head = {"model.norm.weight": source.get("model.norm.weight")}
        if not cfg.tie_word_embeddings:
            head["lm_head.weight"] = source.get("lm_head.weight")
        w.add_layer("head", head)
        with tempfile.TemporaryDirectory() as tmp:
            load_tokenizer(gguf).save(Path(tmp))
            w.copy_files(Path(tmp), TOKENIZER_FILES)
        return w.commit()


def smollm2_int4_path(gguf: Path) -> Path:
    """The cached INT4 checkpoint of the GGUF model, built on first use."""
    st = gguf.stat()
    out = cache_dir() / "test-models" / f"{gguf.stem}-{RECIPE}-{st.st_size}-{st.st_mtime_ns}"
    if is_checkpoint(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_int4_checkpoint(gguf, out)
