"""Random-weight models of named shapes, built straight on the device: benchmarks need no checkpoint.

    model = build_random_model("llama-3-8b", bits=4, device="cuda", dtype=torch.float16)
    model = build_random_gguf_model("llama-3-8b", "Q4_K_M", device="cuda", dtype=torch.float16)
    write_random_checkpoint("llama-3-8b", "/tmp/llama8b-int4", device="cuda")   # for pipeline workers

Quantized linears get random GPTQ tensors (uniform codes of mean zero, symmetric zero, one scale per group
and output) and choose their kernel through the registry exactly as a loaded checkpoint does;
`bits=16` builds plain fp linears. Scales are sized so that each linear roughly preserves the
variance of its input, which keeps the activations of a deep random model finite in fp16.
`build_random_gguf_model` builds the model a GGUF file of one llama.cpp type (or mix) loads into:
every linear, the embedding and the lm_head in GGUF blocks of random codes, on the kernels a
loaded file gets.
`write_random_checkpoint` writes the same kind of weights (generated on the device, one layer at
a time) as a flotilla checkpoint, for processes that load a path: pipeline workers.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight
from flotilla.kernels.gptq import pack_rows
from flotilla.models.checkpoint import CheckpointWriter
from flotilla.models.config import GEMMA_ACT, GGUFQuant, ModelConfig, QuantConfig, RopeScaling, gemma_layer_types
from flotilla.models.gguf_linear import GGUFLinear, GGUFTable
from flotilla.models.linear import Linear, QuantLinear
from flotilla.models.llama import CausalLM, RMSNorm
from flotilla.models.weights import build_stage

_LLAMA3 = dict(architecture="LlamaForCausalLM", vocab_size=128256, head_dim=128, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
               bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16")

SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, **_LLAMA3),
    "llama-3-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, **_LLAMA3),
    "qwen3-8b": ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                            tie_word_embeddings=False, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,),
                            torch_dtype="bfloat16"),
    # Phi-3-mini (3.8B): heads 96 wide, q/k/v and gate/up stored fused (its 2047-token window left out here)
    "phi-3-mini": ModelConfig(architecture="Phi3ForCausalLM", vocab_size=32064, hidden_size=3072,
                              intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=32, head_dim=96, rms_norm_eps=1e-5, rope_theta=10000.0,
                              max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_ids=(32000, 32007), torch_dtype="bfloat16"),
    # Gemma 3 4B's text model: 34 layers, 256-wide heads, five sliding layers (1024 tokens, rope base 10k) to a global
    # one (rope 1M, linear x8), output norms, gelu; the lm_head stored apart here (Gemma ties it to the embedding)
    "gemma-3-4b": ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=262208, hidden_size=2560,
                              intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              max_position_embeddings=131072, tie_word_embeddings=False, qk_norm=True,
                              rope_scaling=RopeScaling("linear", factor=8.0), sliding_window=1024,
                              layer_types=gemma_layer_types(34, 6),
                              rope_local_theta=10000.0, query_pre_attn_scalar=256.0, hidden_act=GEMMA_ACT,
                              bos_token_id=2, eos_token_ids=(1, 106), torch_dtype="bfloat16"),
    # small enough for CPU tests; every linear's input is a multiple of group size 128
    "tiny": ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                        tie_word_embeddings=False, eos_token_ids=()),
    "tiny-qwen3": ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
                              tie_word_embeddings=False, qk_norm=True, eos_token_ids=()),
}

BITS = (4, 8, 16)  # 16: unquantized linears in the activation dtype


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """A (transformers) model's weights replaced in place by larger-than-init ones, so that errors show in its
    logits: norms 1 + N(0, 0.1), everything else N(0, 0.08) (the tests' and GPU checks' oracle models)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    return model


def shape_config(name: str, bits: int = 16, group_size: int = 128, num_layers: int | None = None,
                 head_bits: int | None = None) -> ModelConfig:
    """The config of a named shape, quantized to `bits` (GPTQ, symmetric, `group_size`); the lm_head
    quantized too to `head_bits` (4 or 8) when given, else fp16."""
    if name not in SHAPES:
        raise FlotillaError(f"unknown model shape {name!r}; valid: {', '.join(SHAPES)}")
    if bits not in BITS:
        raise FlotillaError(f"--bits {bits}: expected one of {', '.join(map(str, BITS))}")
    cfg = SHAPES[name]
    if num_layers is not None:  # fewer layers than the shape's, or more (small shapes, deep splits)
        if num_layers < 1:
            raise FlotillaError(f"--layers {num_layers}: a model needs at least one layer")
        cfg = replace(cfg, num_hidden_layers=num_layers)
        if cfg.layer_types is not None:  # Gemma's pattern (its first global layer's position) over the new depth
            cfg = replace(cfg, layer_types=gemma_layer_types(num_layers, cfg.layer_types.index("full_attention") + 1))
    if head_bits is not None and (bits == 16 or head_bits not in (4, 8)):
        raise FlotillaError(f"--head-bits {head_bits}: expected 4 or 8, on a quantized model (--bits 4 or 8)")
    quant = None if bits == 16 else QuantConfig(bits=bits, group_size=group_size, sym=True, method="rtn")
    if quant is not None and head_bits is not None:
        dynamic = () if head_bits == bits else ((r"+:^lm_head$", (("bits", head_bits),)),)
        quant = replace(quant, lm_head=True, dynamic=dynamic)
    return cfg.with_quant(quant)


@torch.no_grad()
def build_random_model(name: str, bits: int = 4, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, group_size: int = 128, seed: int = 0,
                       num_layers: int | None = None, head_bits: int | None = None,
                       keep_source: bool = False) -> CausalLM:
    """A whole model of shape `name` with random weights, ready for a ModelRunner (`keep_source`:
    QuantLinear.prepare's)."""
    cfg = shape_config(name, bits, group_size, num_layers, head_bits)
    device = torch.device(device)
    model = build_stage(cfg, None, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            _fill_quant(mod, gen)
        elif isinstance(mod, Linear):
            mod.weight.normal_(0, mod.in_features ** -0.5, generator=gen)
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, RMSNorm):
            mod.weight.fill_(1.0 - mod.offset)  # a scale of 1 (Gemma's norms: 1 + weight)
    model.model.embed_tokens.weight.normal_(0, 1.0, generator=gen)
    if not isinstance(model.lm_head, QuantLinear):
        model.lm_head.weight.normal_(0, cfg.hidden_size ** -0.5, generator=gen)
    model.build_rope()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.prepare(dtype, keep_source)
    return model


def _fill_quant(mod: QuantLinear, gen: torch.Generator) -> None:
    _random_gptq(mod.qweight, mod.qzeros, mod.scales, mod.g_idx, mod.bits, mod.group_size, gen)
    if mod.bias is not None:
        mod.bias.zero_()


def _random_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 group_size: int, gen: torch.Generator) -> None:
    """Fill one linear's GPTQ tensors in place: uniform random codes 1 .. 2**bits - 1, zero at the middle code
    2**(bits - 1) (the symmetric checkpoint's constant zero), scales around 1 / (std(code - zero) * sqrt(in)).
    Code 0 is left out so that the weights have mean zero: with all 2**bits codes they average half a step
    below the zero, every linear's output carries the same rank-one shift (the sum of its input), the
    layers' deltas line up, and the residual stream of a deep model grows linearly until fp16 overflows
    (llama-3-70b's 80 layers did, at layer 35)."""
    n_in = g_idx.numel()
    per = 32 // bits
    chunk = max(1, (1 << 24) // max(1, per * qweight.shape[1]))  # word rows at a time: ~16M codes
    for r0 in range(0, qweight.shape[0], chunk):
        rows = qweight[r0:r0 + chunk]
        codes = torch.randint(1, 1 << bits, (rows.shape[0] * per, rows.shape[1]), generator=gen,
                              device=qweight.device, dtype=torch.int64)
        rows.copy_(pack_rows(codes, bits))
    field = (1 << (bits - 1)) - 1  # the stored zero - 1 (gptq convention)
    word = sum(field << (i * bits) for i in range(per))
    qzeros.fill_(word - 2**32 if word >= 2**31 else word)
    n_codes = (1 << bits) - 1  # uniform over n_codes values centred on the zero
    code_std = math.sqrt((n_codes ** 2 - 1) / 12)
    base = 1.0 / (code_std * math.sqrt(n_in))
    scales.uniform_(0.5 * base, 1.5 * base, generator=gen)
    g_idx.copy_(torch.arange(n_in, device=g_idx.device, dtype=torch.int32) // (n_in if group_size == -1 else group_size))


# --------------------------------------------------------------------- random GGUF models

GGUF_MIXES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q4_K_M", "Q5_K_M")
GGUF_ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize reads them
# a tensor whose rows are not whole blocks of its type gets llama.cpp's fallback (llama_tensor_get_type)
_GGUF_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def gguf_mix(name: str) -> str:
    """A llama.cpp file type as `--gguf` takes it (any case; Q4_K and Q5_K: the _M mixes)."""
    mix = GGUF_ALIASES.get(name.upper(), name.upper())
    if mix not in GGUF_MIXES:
        raise FlotillaError(f"--gguf {name}: expected one of {', '.join(GGUF_MIXES)} (or Q4_K, Q5_K: the _M mixes)")
    return mix


def gguf_tensor_type(mix: str, tensor: str, layer: int, num_layers: int, n_in: int | None = None,
                     is_70b: bool = False) -> str:
    """The type llama.cpp's quantizer (llama_tensor_get_type) gives `tensor` ("token_embd", "output",
    "attn_q", "attn_v", "ffn_down", ...) of decoder layer `layer` in a file of type `mix`: the output
    (lm_head) is Q6_K unless the file is Q8_0; in the _M mixes attn_v and ffn_down are Q6_K in the
    first and last eighth of the layers and every third layer between (use_more_bits), and a 70B
    model's other attn_v are Q5_K; everything else is the base type. With `n_in` (the row length),
    rows that are not whole blocks of that type take llama.cpp's fallback (Q4_K -> Q5_0, Q5_K ->
    Q5_1, Q6_K -> Q8_0; the output Q8_0)."""
    base = gguf_mix(mix).removesuffix("_M")
    kind = base
    if tensor == "output":
        kind = "Q8_0" if base == "Q8_0" else "Q6_K"
    elif mix.endswith("_M") and tensor in ("attn_v", "ffn_down"):
        eighth = num_layers // 8
        if layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2:
            kind = "Q6_K"
        elif tensor == "attn_v" and is_70b and base == "Q4_K":
            kind = "Q5_K"
    if n_in is not None and n_in % GGML_FORMATS[kind].block:
        kind = "Q8_0" if tensor == "output" else _GGUF_FALLBACK.get(kind, kind)
    return kind


def random_ggml_weight(qtype: str, n_out: int, n_in: int, gen: torch.Generator, std: float | None = None) -> GGMLWeight:
    """Random blocks of a GGUF type, in its decoded form (GGMLWeight), on the generator's device: codes
    uniform and centred on zero (a form with a min gets min = -scale * the middle code; one without
    leaves out its lowest code, so that codes -q .. q remain), scales per group uniform in 0.5-1.5 of a
    base that makes the weight's standard deviation `std` (default 1 / sqrt(n_in): the linear keeps
    its input's variance). Scales (and mins) of the fp16-scale types are rounded to fp16."""
    fmt = GGML_FORMATS[qtype]
    if n_in % fmt.block:
        raise ValueError(f"{qtype} rows are whole {fmt.block}-weight blocks; {n_in} is not a multiple")
    device = gen.device
    low = fmt.code_min if fmt.has_min else fmt.code_min + 1
    codes = torch.randint(low, fmt.code_max + 1, (n_out, n_in), generator=gen, device=device, dtype=torch.int8)
    n_codes = fmt.code_max + 1 - low
    code_std = math.sqrt((n_codes ** 2 - 1) / 12)
    base = (n_in ** -0.5 if std is None else std) / code_std
    scales = torch.empty(n_out, n_in // fmt.group, device=device).uniform_(0.5 * base, 1.5 * base, generator=gen)
    if fmt.fp16_scales:
        scales = scales.half().float()
    mins = None
    if fmt.has_min:
        mins = -scales * ((fmt.code_min + fmt.code_max) / 2)
        if fmt.fp16_scales:
            mins = mins.half().float()
    return GGMLWeight(qtype, codes, scales, mins)


_GGUF_NAMES = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


@torch.no_grad()
def build_random_gguf_model(name: str, mix: str = "Q4_K_M", device: torch.device | str = "cpu",
                            dtype: torch.dtype = torch.float32, seed: int = 0,
                            num_layers: int | None = None) -> CausalLM:
    """A whole model of shape `name` as a GGUF file of type `mix` loads (gguf_tensor_type says which
    tensor gets which type; the embedding is the base type), random blocks built on `device` one
    tensor at a time and packed for its kernels as the loader packs them."""
    mix = gguf_mix(mix)
    cfg = shape_config(name, 16, num_layers=num_layers).with_quant(GGUFQuant())
    # llama.cpp's 70B type: 80 layers with grouped KV heads (65B: 80 without)
    is_70b = cfg.num_hidden_layers == 80 and cfg.num_attention_heads != cfg.num_key_value_heads
    device = torch.device(device)
    model = build_stage(cfg, None, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    n = cfg.num_hidden_layers

    def weight(tensor: str, layer: int, n_out: int, n_in: int, std: float | None = None) -> GGMLWeight:
        qtype = gguf_tensor_type(mix, tensor, layer, n, n_in, is_70b)
        if n_in % GGML_FORMATS[qtype].block:
            raise FlotillaError(f"--random {name} --gguf {mix}: {tensor} would be {qtype}, whose rows are whole "
                                f"{GGML_FORMATS[qtype].block}-weight blocks, but its rows are {n_in} wide")
        return random_ggml_weight(qtype, n_out, n_in, gen, std)

    for key, layer in model.model.layers.items():
        for path, tensors in _GGUF_NAMES.items():
            mod = layer.get_submodule(path)
            for shard, (tensor, n_out) in enumerate(zip(tensors, mod.out_sizes)):
                mod.load("weight", shard, weight(tensor, int(key), n_out, mod.in_features))
            mod.prepare(dtype, device)
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.weight.fill_(1.0 - mod.offset)
    embed, head = model.model.embed_tokens, model.lm_head
    embed.load("weight", 0, weight("token_embd", 0, cfg.vocab_size, cfg.hidden_size, std=1.0))
    embed.prepare(dtype, device)
    if head.weight is not embed.weight:  # untied (every named shape)
        head.load("weight", 0, weight("output", 0, cfg.vocab_size, cfg.hidden_size))
        head.prepare(dtype, device)
    model.build_rope()
    return model


def _projections(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(checkpoint name, input features, output features) of each decoder linear."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
            ("self_attn.o_proj", q, h), ("mlp.gate_proj", h, i), ("mlp.up_proj", h, i), ("mlp.down_proj", i, h)]


@torch.no_grad()
def write_random_checkpoint(name: str, out: str | Path, bits: int = 4, group_size: int = 128, seed: int = 0,
                            device: torch.device | str = "cpu", num_layers: int | None = None,
                            head_bits: int | None = None) -> Path:
    """A flotilla checkpoint (GPTQ layout, fp16 embedding, norms and lm_head) of shape `name` with
    the weights `build_random_model` makes, generated on `device` from one seeded generator (same
    seed and device: the same bytes), one layer at a time through the checkpoint writer. No
    tokenizer: drive it with token ids. Replaces `out` if it exists."""
    if bits not in (4, 8):
        raise FlotillaError(f"a random checkpoint is quantized: --bits 4 or 8, got {bits}")
    cfg = shape_config(name, bits, group_size, num_layers, head_bits)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    h = cfg.hidden_size

    def gptq(prefix: str, n_in: int, n_out: int, bits: int) -> dict[str, torch.Tensor]:
        per_word, groups = 32 // bits, 1 if group_size == -1 else n_in // group_size
        t = {"qweight": torch.empty(n_in // per_word, n_out, dtype=torch.int32, device=device),
             "qzeros": torch.empty(groups, n_out // per_word, dtype=torch.int32, device=device),
             "scales": torch.empty(groups, n_out, dtype=torch.float16, device=device),
             "g_idx": torch.empty(n_in, dtype=torch.int32, device=device)}
        _random_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, group_size, gen)
        return {f"{prefix}.{k}": v for k, v in t.items()}

    def normal(rows: int, std: float) -> torch.Tensor:
        return torch.empty(rows, h, device=device).normal_(0, std, generator=gen).half()

    def unit(n: int) -> torch.Tensor:  # a norm weight that scales by 1 (Gemma's norms: 1 + weight)
        return torch.full((n,), 1.0 - cfg.norm_offset, dtype=torch.float16)

    with CheckpointWriter(out, cfg, force=True) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": normal(cfg.vocab_size, 1.0)})
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            tensors = {f"{p}{norm}.weight": unit(h) for norm in ("input_layernorm", "post_attention_layernorm")}
            if cfg.qk_norm:  # a Qwen3 shape: its q and k heads' norms
                tensors.update({f"{p}self_attn.{norm}.weight": unit(cfg.head_dim) for norm in ("q_norm", "k_norm")})
            if cfg.sandwich_norms:  # Gemma 3: the norms before the MLP and of the MLP's output
                tensors.update({f"{p}{norm}.weight": unit(h)
                                for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm")})
            for proj, n_in, n_out in _projections(cfg):
                tensors.update(gptq(f"{p}{proj}", n_in, n_out, bits))
            w.add_layer(str(layer), tensors)
        head_quant = cfg.quant.head_quant()
        head = (gptq("lm_head", h, cfg.vocab_size, head_quant.bits) if head_quant is not None
                else {"lm_head.weight": normal(cfg.vocab_size, h ** -0.5)})
        w.add_layer("head", {"model.norm.weight": unit(h), **head})
        return w.commit()


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads from the weights: every linear's kernel-side tensors (the GPTQ
    tensors where the kernel keeps no repacked layout), the lm_head and the norms; the embedding
    contributes one row per token and is left out."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            layout = getattr(mod.kernel, "layout", None)  # the Triton kernel's repacked tensors
            if layout is None:
                total += mod.weight_bytes()
            else:
                total += sum(t.numel() * t.element_size() for t in (layout.words, layout.scales, layout.zeros)
                             if t is not None)
        elif isinstance(mod, (Linear, RMSNorm)):
            total += sum(p.numel() * p.element_size() for p in mod.parameters())
        elif isinstance(mod, GGUFLinear):  # a GGUF file's linear: its kernel's form (Triton, CPU packs, torch)
            total += mod.kernel.nbytes
    head = model.lm_head
    if head is not None and not isinstance(head, QuantLinear):  # a quantized one: above
        w = head.weight
        total += w.nbytes if isinstance(w, GGUFTable) else w.numel() * w.element_size()
    return total
