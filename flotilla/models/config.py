"""Model and quantization configs, parsed from a Hugging Face config.json or GGUF metadata.

An unknown architecture or an unsupported field value is a FlotillaError naming it; nothing
falls back to a silent default.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from flotilla.errors import FlotillaError

# Hugging Face architecture name -> (family, qkv bias by construction)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2's layout without its q/k/v bias, with an RMSNorm on each q and k head
    "Phi3ForCausalLM": "phi3",  # Llama's layer with q/k/v and gate/up stored fused (models/fused_names.py), longrope
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text model (models/llama.py's module docstring)
    "Gemma2ForCausalLM": "gemma2",  # Gemma 3's layer without q/k norms, one rope, with Gemma 2's soft-capping
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM"}
GEMMA_FAMILIES = ("gemma2", "gemma3")
# config.json's model_type of a family, where it is not the family's name
_FAMILY_MODEL_TYPE = {"gemma3": "gemma3_text"}
# Gemma2Config's / Gemma3TextConfig's defaults, for the keys a config.json may leave out (a multimodal model's
# text_config does)
_GEMMA2_DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 8192, "tie_word_embeddings": True, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "rope_theta": 10000.0, "final_logit_softcapping": 30.0,
                    "attn_logit_softcapping": 50.0}
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
# a multimodal checkpoint whose text model flotilla runs: its text_config, its weights under these prefixes
MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
MULTIMODAL_PREFIXES = ("language_model.model.", "model.language_model.")  # transformers 4's, 5's -> "model."

GEMMA_ACT = "gelu_pytorch_tanh"


def gemma_layer_types(layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's layers by a pattern: every pattern-th layer global (Gemma 2: 2, Gemma 3: 6), the rest sliding."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers))
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # Phi-3's older names, as transformers reads them for Phi-3
# families whose checkpoints store q/k/v and gate/up as one tensor each, under these names (models/fused_names.py)
FUSED_FAMILIES = ("phi3",)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# the same by leaf names: ("q_proj", "k_proj", "v_proj") -> "qkv_proj"
FUSED_LEAVES = {tuple(p.rsplit(".", 1)[1] for p in parts): fused.rsplit(".", 1)[1] for fused, parts in FUSED.items()}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors for positions within the original context and past it (rope.py), and
    # the factor cos / sin are scaled by (given, or sqrt(1 + ln(factor) / ln(original)) as transformers computes it)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    KEYS: ClassVar[dict[str, tuple[str, ...]]] = {  # what config.json's rope_scaling holds per type
        "linear": ("rope_type", "factor"),
        "llama3": ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": ("rope_type", "factor", "short_factor", "long_factor", "attention_factor"),
    }



DYNAMIC_KEYS = ("bits", "group_size", "sym", "desc_act")  # per-module overrides flotilla honours
CONVERTED = ("awq", "bitsandbytes")  # community layouts read as gptq_v2 tensors
FORMATS = ("gptq", "gptq_v2", *CONVERTED)


@dataclass(frozen=True)
class QuantConfig:
    """The `quantization_config` of a GPTQ checkpoint (ours or a community one).

    `dynamic` is GPTQModel's per-module override table, as vLLM reads it too: (pattern, overrides)
    pairs tried in order against a checkpoint module name (`model.layers.3.mlp.down_proj`) with
    `re.match`; the first that matches decides. A "-:" pattern leaves the module unquantized (a
    plain fp16 `weight`); "+:" or no prefix overrides bits/group_size/sym/desc_act for it.

    `checkpoint_format` is how the files store the linears: "gptq" (zeros stored minus one),
    "gptq_v2" (GPTQModel: zeros as they are), or a community layout that the source converts to
    gptq_v2 tensors as it reads them (CONVERTED: AutoAWQ's GEMM layout, bitsandbytes'; see
    models/converted_source.py)."""

    bits: int
    group_size: int
    sym: bool = True
    desc_act: bool = False
    damp_percent: float = 0.01
    checkpoint_format: str = "gptq"
    method: str = "gptq"  # how it was made: gptq, rtn, awq or awq+gptq (all stored in the GPTQ layout)
    dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    lm_head: bool = False  # the lm_head is stored quantized too (GPTQModel's flag; vLLM reads it)
    rotation: str = ""  # quantize --rotate's record ("r1 hadamard-576, r2 hadamard-64, seed 0"): folded
    #                     into the weights already, so a reader needs nothing; other tools ignore the key

    def for_module(self, names: Sequence[str]) -> "QuantConfig | None":
        """The config of one linear made of the checkpoint projections `names` (one, or the q/k/v or
        gate/up of a merged linear, which must agree); None when `dynamic` leaves it unquantized."""
        resolved = [self._resolve(n) for n in names]
        if any(r != resolved[0] for r in resolved):
            raise FlotillaError(f"quantization_config.dynamic gives {', '.join(names)} different settings "
                                f"({', '.join(_describe(r) for r in resolved)}); flotilla merges these projections "
                                "into one linear, so they must share one")
        return resolved[0]

    def _resolve(self, name: str) -> "QuantConfig | None":
        for pattern, overrides in self.dynamic:
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None
            elif re.match(pattern.removeprefix("+:"), name):
                return dataclasses.replace(self, dynamic=(), **dict(overrides))
        return dataclasses.replace(self, dynamic=()) if self.dynamic else self

    def head_quant(self) -> "QuantConfig | None":
        """The config of a quantized lm_head (`dynamic` may give it other bits, as GPTQModel and
        vLLM resolve the module name `lm_head`), or None when the head is stored in fp16."""
        return self.for_module(["lm_head"]) if self.lm_head else None

    def describe(self) -> str:
        """What the files hold, for the load line: 'GPTQ INT4 g128 act-order', 'AutoAWQ GEMM INT4 g128 (repacked)'."""
        layout = {"gptq": "GPTQ", "gptq_v2": "GPTQ v2", "awq": "AutoAWQ GEMM",
                  "bitsandbytes": f"bitsandbytes {self.method.removeprefix('bitsandbytes-')}, read as"}
        group = "per channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = "".join((" act-order" if self.desc_act else "", "" if self.sym else " asym",
                         " (repacked)" if self.checkpoint_format == "awq" else "", ", mixed" if self.dynamic else ""))
        return f"{layout.get(self.checkpoint_format, self.checkpoint_format)} INT{self.bits} {group}{extra}"

    @property
    def zero_offset(self) -> int:
        """What a reader adds to a stored zero field (kernels/gptq.py)."""
        return 1 if self.checkpoint_format == "gptq" else 0

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
            "damp_percent": self.damp_percent,
            "checkpoint_format": self.checkpoint_format,
            "true_sequential": True,
            "lm_head": self.lm_head,
            "flotilla_method": self.method,
            **({"dynamic": {p: dict(o) for p, o in self.dynamic}} if self.dynamic else {}),
            **({"flotilla_rotation": self.rotation} if self.rotation else {}),
        }

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "QuantConfig":
        method = d.get("quant_method")
        if method in CONVERTED:
            from .converted_source import community_quant

            return community_quant(d, where)
        if method != "gptq":
            raise FlotillaError(f"{where}: quantization_config.quant_method is {method!r}; supported: gptq, "
                                f"{', '.join(CONVERTED)}")
        key = "checkpoint_format" if "checkpoint_format" in d or "format" not in d else "format"
        fmt = d.get(key, "gptq")  # GPTQModel's early configs said `format`
        if "format" in d and "checkpoint_format" in d and d["format"] != fmt:
            raise FlotillaError(f"{where}: quantization_config says checkpoint_format {fmt!r} and format "
                                f"{d['format']!r}; which layout the files hold is unclear: keep the right one")
        if d.get("is_marlin_format"):  # AutoGPTQ 0.6's repacked Marlin layout
            raise FlotillaError(f"{where}: quantization_config.is_marlin_format is set: AutoGPTQ's Marlin layout "
                                "is not supported; use the GPTQ checkpoint it was made from")
        if fmt not in FORMATS:  # (a flotilla config of a converted layout says so here: pipeline probes)
            raise FlotillaError(f"{where}: quantization_config.{key} {fmt!r} is not supported "
                                f"(expected gptq or gptq_v2; AutoAWQ's and bitsandbytes' checkpoints say theirs in "
                                f"quant_method)")
        bits = d.get("bits")
        if bits not in (4, 8):
            raise FlotillaError(f"{where}: quantization_config.bits is {bits!r}; supported: 4, 8")
        pack = str(d.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":  # GPTQModel's option: qweight / qzeros words of another width
            raise FlotillaError(f"{where}: quantization_config.pack_dtype is {d['pack_dtype']!r}; flotilla reads "
                                "int32-packed GPTQ tensors (GPTQModel's default): re-save with pack_dtype int32")
        return cls(bits=bits, group_size=int(d.get("group_size", -1)), sym=bool(d.get("sym", True)),
                   desc_act=bool(d.get("desc_act", False)), damp_percent=float(d.get("damp_percent", 0.01)),
                   checkpoint_format=fmt, method=d.get("flotilla_method", "gptq"),
                   dynamic=_parse_dynamic(d.get("dynamic"), where), lm_head=bool(d.get("lm_head", False)),
                   rotation=str(d.get("flotilla_rotation", "")))


def _parse_dynamic(d: Any, where: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    if not d:
        return ()
    if not isinstance(d, dict):
        raise FlotillaError(f"{where}: quantization_config.dynamic must be an object of pattern -> overrides")
    out = []
    for pattern, overrides in d.items():
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise FlotillaError(f"{where}: quantization_config.dynamic pattern {pattern!r} is not a regex ({e})") from None
        if not isinstance(overrides, dict):
            raise FlotillaError(f"{where}: quantization_config.dynamic[{pattern!r}] must be an object")
        unknown = sorted(set(overrides) - set(DYNAMIC_KEYS))
        if unknown and not pattern.startswith("-:"):
            raise FlotillaError(f"{where}: quantization_config.dynamic[{pattern!r}] overrides {', '.join(unknown)}; "
                                f"flotilla honours {', '.join(DYNAMIC_KEYS)}")
        if overrides.get("bits", 4) not in (4, 8):
            raise FlotillaError(f"{where}: quantization_config.dynamic[{pattern!r}] bits {overrides['bits']!r}; "
                                "supported: 4, 8")
        kept = tuple((k, overrides[k]) for k in DYNAMIC_KEYS if k in overrides)
        out.append((pattern, () if pattern.startswith("-:") else kept))
    return tuple(out)


def _describe(q: "QuantConfig | None") -> str:
    return "unquantized" if q is None else f"{q.bits}-bit g{q.group_size}"


@dataclass(frozen=True)
class GGUFQuant:
    """The weights stay in a GGUF file's own blocks, each tensor in its type (Q4_K, Q6_K, … mixed
    within one model), and run through flotilla's kernels for those forms (models/gguf_linear.py).
    Nothing to write into a config.json: a checkpoint is never in this form."""

    method: str = "gguf"

    def to_hf(self) -> None:
        return None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Llama: q, k, v and o
    qkv_bias: bool = False  # Qwen2: q, k and v only
    qk_norm: bool = False  # Qwen3: an RMSNorm (weight [head_dim]) on every q and k head before rope
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # the layers that layer_window names attend to the last this many tokens
    # Qwen2 / Qwen3's max_window_layers: layers below it attend to the whole context, the rest to the window
    window_layers: int | None = None
    # Gemma: each layer's "sliding_attention" (the window; Gemma 3's rope_local_theta) or "full_attention"
    layer_types: tuple[str, ...] | None = None
    attn_softcap: float | None = None  # Gemma 2: each attention score s -> cap * tanh(s / cap)
    final_softcap: float | None = None  # Gemma 2: each logit -> cap * tanh(logit / cap)
    rope_local_theta: float | None = None  # Gemma 3's sliding layers' rope base (unscaled)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale query_pre_attn_scalar ** -0.5
    hidden_act: str = "silu"  # or Gemma's GEMMA_ACT
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    quant: QuantConfig | GGUFQuant | None = None
    # the final norm's weight is a [hidden, hidden] matrix (`model.norm_matrix.weight`, llama.NormMatrix)
    # after a norm of ones: quantize --rotate-tied-head; config.json's `flotilla_final_norm_matrix`
    final_norm_matrix: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def norm_offset(self) -> float:
        """Gemma's RMSNorms multiply by 1 + weight (the checkpoint's weight kept as it is)."""
        return 1.0 if self.family in GEMMA_FAMILIES else 0.0

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2 / 3's layer: norms of the attention's and the MLP's outputs too."""
        return self.family in GEMMA_FAMILIES

    @property
    def embed_scale(self) -> float | None:
        """Gemma's embedding is multiplied by sqrt(hidden)."""
        return self.hidden_size ** 0.5 if self.family in GEMMA_FAMILIES else None

    def layer_rope_local(self, layer: int) -> bool:
        """Whether `layer` takes the sliding layers' rope (Gemma 3's rope_local_theta)."""
        return self.rope_local_theta is not None and self.layer_types is not None \
            and self.layer_types[layer] == "sliding_attention"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest context we serve: the model's own (its sliding-window layers attend within their window)."""
        return self.max_position_embeddings

    @property
    def kv_window(self) -> int:
        """Where every layer attends within a sliding window (Mistral 7B v0.1, Phi-3), the widest of them: a
        sequence's keys further back than that are read by no layer again. 0 where any layer reads the whole
        context (Gemma's global layers, Qwen2's lower ones)."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return max(windows) if windows and all(windows) else 0

    def layer_window(self, layer: int) -> int:
        """The sliding window that `layer` attends within, 0 for the whole context (as transformers' layer_types:
        Mistral's and Phi-3's every layer, Qwen's from max_window_layers on)."""
        window = self.sliding_window
        if not window or window >= self.max_position_embeddings:
            return 0  # no sequence is longer than the window: plain causal attention, with no mask to build
        if self.window_layers is not None and layer < self.window_layers:
            return 0
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return 0
        return window

    def linear_quant(self, prefix: str, projections: Sequence[str]) -> QuantConfig | GGUFQuant | None:
        """The quantization of the linear made of checkpoint projections `prefix` + each of
        `projections` (e.g. "model.layers.3.self_attn.", ("q_proj", "k_proj", "v_proj")), after any
        per-module `dynamic` override; None for a plain linear."""
        if isinstance(self.quant, QuantConfig):
            leaves = tuple(p.rsplit(".", 1)[-1] for p in projections)
            if self.family in FUSED_FAMILIES and leaves in FUSED_LEAVES:  # stored as one: its own name decides
                return self.quant.for_module([(prefix + projections[0]).rsplit(".", 1)[0] + "." + FUSED_LEAVES[leaves]])
            return self.quant.for_module([prefix + p for p in projections])
        return self.quant

    def with_quant(self, quant: QuantConfig | GGUFQuant | None) -> "ModelConfig":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["quant"] = quant
        return ModelConfig(**d)

    # ----------------------------------------------------------------- Hugging Face
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
            hint = f"; give the file itself: {ggufs[0]}" if len(ggufs) == 1 else (
                f"; give one of its .gguf files ({', '.join(g.name for g in ggufs[:4])}"
                f"{', …' if len(ggufs) > 4 else ''})"
                if ggufs else "")
            raise FlotillaError(f"{path}: no config.json (expected a Hugging Face model directory, "
                                f"a flotilla checkpoint or a .gguf file){hint}")
        try:
            d = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FlotillaError(f"{cfg_file}: not valid JSON ({e})") from None
        legacy = path / "quantize_config.json"  # AutoGPTQ's own file, where config.json says nothing of it
        if isinstance(d, dict) and not d.get("quantization_config") and legacy.is_file():
            try:
                qc = json.loads(legacy.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise FlotillaError(f"{legacy}: not valid JSON ({e})") from None
            if not isinstance(qc, dict):
                raise FlotillaError(f"{legacy}: expected a JSON object")
            d = {**d, "quantization_config": {"quant_method": "gptq", **qc}}
            return cls.from_hf_dict(d, where=f"{cfg_file} (with {legacy.name})")
        return cls.from_hf_dict(d, where=str(cfg_file))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        outer = (d.get("architectures") or [None])[0] or {"gemma3": "Gemma3ForConditionalGeneration"}.get(
            d.get("model_type"))
        if outer in MULTIMODAL_TEXT:  # the text model of an image-text checkpoint (its vision tower is not read)
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise FlotillaError(f"{where}: {outer} without a text_config")
            top = {k: d[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config",
                                     "tie_word_embeddings") if d.get(k) is not None}
            # the outer ids win: a re-saved text_config may hold eos 1 alone, where the model's ends are [1, 106]
            keep_text = {k: v for k, v in top.items() if k not in text or k in ("eos_token_id", "bos_token_id")}
            d = {**text, **keep_text, "architectures": [MULTIMODAL_TEXT[outer]]}
        arch = _hf_architecture(d, where)
        if ARCHITECTURES[arch] in GEMMA_FAMILIES:
            defaults = _GEMMA3_DEFAULTS if ARCHITECTURES[arch] == "gemma3" else _GEMMA2_DEFAULTS
            # a key left out, or null, takes the default; but a null soft-cap means none (as transformers reads it)
            d = {**defaults, **{k: v for k, v in d.items()
                                if v is not None or k not in defaults or k.endswith("_softcapping")}}
        family = ARCHITECTURES[arch]

        def req(key):
            if key not in d or d[key] is None:
                raise FlotillaError(f"{where}: missing field {key!r}")
            return d[key]

        heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        rope = d.get("rope_parameters") or {}
        legacy = d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        max_pos = int(d.get("max_position_embeddings", 2048))
        # (Phi3Config's original context defaults to 4096)
        original = d.get("original_max_position_embeddings") or (4096 if family == "phi3" else None)
        scaling = _rope_scaling(legacy or rope, where, max_pos, original, aliases=family == "phi3")
        partial = next((f for f in (d.get("partial_rotary_factor"), rope.get("partial_rotary_factor"),
                                    legacy.get("partial_rotary_factor")) if f not in (None, 1, 1.0)), 1.0)
        if partial != 1.0:
            raise FlotillaError(f"{where}: partial_rotary_factor {partial} (rope on part of each head, as "
                                "Phi-4-mini's) is not supported; flotilla rotates whole heads")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding, window_layers = _sliding_window(d, family, int(req("num_hidden_layers")))
        quant = QuantConfig.from_hf(d["quantization_config"], where) if d.get("quantization_config") else None
        head_dim = d.get("head_dim") or hidden // heads
        extra: dict[str, Any] = {}  # the fields of some families only
        if family in GEMMA_FAMILIES:
            extra = _gemma_fields(d, where, family, int(req("num_hidden_layers")), max_pos)
            rope_theta, scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        elif family in ("qwen2", "qwen3") and (types := _qwen_layer_types(d, where, int(req("num_hidden_layers")))):
            extra["layer_types"] = types  # each layer's attention (ModelConfig.layer_window)
        if family not in GEMMA_FAMILIES and d.get("hidden_act", "silu") != "silu":
            raise FlotillaError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported (expected 'silu')")
        return cls(**extra,
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)) and family != "qwen2",
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "gemma3"),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=int(sliding) if sliding else None,
            window_layers=window_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quant=quant,
            final_norm_matrix=bool(d.get("flotilla_final_norm_matrix", False)),
            extra={"multimodal": outer} if outer in MULTIMODAL_TEXT else {},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers and vLLM read back as the same model."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _FAMILY_MODEL_TYPE.get(self.family, self.family),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.torch_dtype,
        }
        if self.family == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = self.mlp_bias
        if self.family == "qwen3":
            d["attention_bias"] = self.attention_bias
        if self.family in GEMMA_FAMILIES:  # as transformers 4 wrote it (transformers 5 reads it into rope_parameters)
            d.pop("hidden_act")
            scalar = self.query_pre_attn_scalar
            d.update(hidden_activation=self.hidden_act, query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
                     layer_types=list(self.layer_types or ()), attention_bias=self.attention_bias,
                     final_logit_softcapping=self.final_softcap, attn_logit_softcapping=self.attn_softcap,
                     rope_scaling=None)
            if self.family == "gemma3":
                d["rope_local_base_freq"] = self.rope_local_theta
        if self.sliding_window:
            d["sliding_window"] = self.sliding_window
        if self.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = bool(self.sliding_window)
            if self.sliding_window:
                d["max_window_layers"] = self.window_layers or 0
                if self.layer_types is not None:  # a pattern that max_window_layers cannot say
                    d["layer_types"] = list(self.layer_types)
        if self.rope_scaling is not None:
            r = asdict(self.rope_scaling)
            keep = RopeScaling.KEYS[self.rope_scaling.rope_type]
            d["rope_scaling"] = {**{k: list(r[k]) if isinstance(r[k], tuple) else r[k] for k in keep},
                                 "type": self.rope_scaling.rope_type}
            if self.rope_scaling.rope_type == "longrope":  # Phi-3 keeps the original context at the top
                d["original_max_position_embeddings"] = self.rope_scaling.original_max_position_embeddings
        if self.final_norm_matrix:  # flotilla's own: other readers ignore it (and compute other logits)
            d["flotilla_final_norm_matrix"] = True
        if self.quant is not None and self.quant.to_hf() is not None:
            d["quantization_config"] = self.quant.to_hf()
        return d


def _hf_architecture(d: dict, where: str) -> str:
    archs = d.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            names = [*ARCHITECTURES, *(f"{m} (its text model)" for m in MULTIMODAL_TEXT)]
            raise FlotillaError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(names)}")
        return arch
    model_type = d.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise FlotillaError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}")
    return _MODEL_TYPES[model_type]


def _sliding_window(d: dict, family: str, layers: int) -> tuple[int | None, int | None]:
    """(the window, Qwen's max_window_layers) where some layer attends through a sliding window, as transformers
    reads the config: Mistral's always; Qwen2 / Qwen3's only under use_sliding_window, on the layers from
    max_window_layers on (default 28) or those layer_types names; else (None, None)."""
    window = d.get("sliding_window")
    if not window:
        return None, None
    if family in ("mistral", "phi3", *GEMMA_FAMILIES):  # every layer (transformers' Phi-3 masks by it too); Gemma's
        return int(window), None  # sliding layers (ModelConfig.layer_types)
    if not d.get("use_sliding_window"):
        return None, None
    types = d.get("layer_types")
    if isinstance(types, list) and types:  # _qwen_layer_types keeps them where they are not a suffix
        first = next((i for i, t in enumerate(types) if t == "sliding_attention"), None)
        return (int(window), first) if first is not None else (None, None)
    from_layer = int(d.get("max_window_layers", 28))
    return (int(window), from_layer) if layers > from_layer else (None, None)


def _qwen_layer_types(d: dict, where: str, layers: int) -> tuple[str, ...] | None:
    """Qwen2 / Qwen3's layer_types, where they name sliding layers that max_window_layers cannot (not just the
    layers from some index on: an alternating pattern); None where it can, or where no layer slides."""
    types = d.get("layer_types")
    if not d.get("sliding_window") or not d.get("use_sliding_window") or not isinstance(types, list) or not types:
        return None
    _check_layer_types(types, where, layers)
    first = next((i for i, t in enumerate(types) if t == "sliding_attention"), layers)
    return None if all(t == "sliding_attention" for t in types[first:]) else tuple(types)


def _check_layer_types(types, where: str, layers: int) -> None:
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise FlotillaError(f"{where}: layer_types must name sliding_attention or full_attention for each of the "
                            f"{layers} layers")


def _gemma_fields(d: dict, where: str, family: str, layers: int, max_pos: int) -> dict[str, Any]:
    """Gemma 2 / 3's own fields of ModelConfig, and the global rope (rope_theta, rope_scaling), from config.json as
    transformers 5 writes it (layer_types; Gemma 3's rope_parameters per layer type) or 4 did (Gemma 3's
    sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling); what flotilla does not implement is
    refused."""
    caps = {}
    for key, field_name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        cap = d.get(key)
        if cap is not None and (not isinstance(cap, (int, float)) or cap <= 0):
            raise FlotillaError(f"{where}: {key} must be a positive number or null, got {cap!r}")
        caps[field_name] = float(cap) if cap else None
    if d.get("use_bidirectional_attention"):
        raise FlotillaError(f"{where}: use_bidirectional_attention (an embedding model) is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or GEMMA_ACT
    if act != GEMMA_ACT:
        raise FlotillaError(f"{where}: hidden_activation {act!r} is not supported (expected {GEMMA_ACT!r})")
    types = d.get("layer_types")
    if not types:  # every pattern-th layer attends to everything (Gemma 2: every second)
        types = gemma_layer_types(layers, int(d.get("sliding_window_pattern") or (6 if family == "gemma3" else 2)))
    _check_layer_types(types, where, layers)
    params = d.get("rope_parameters") or {}
    if family == "gemma2":  # one rope for every layer
        theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
        scaling = _rope_scaling(d.get("rope_scaling") or params, where, max_pos)
        local_theta = None
    elif "full_attention" in params:  # transformers 5: one rope per layer type
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        theta, local_theta = float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 10000.0))
        if (local.get("rope_type") or "default") != "default":
            raise FlotillaError(f"{where}: the sliding layers' rope_type {local.get('rope_type')!r} is not supported")
        scaling = _rope_scaling(full, where, max_pos)
    else:
        theta = float(d.get("rope_theta", 1e6))
        local_theta = float(d.get("rope_local_base_freq", 10000.0))
        scaling = _rope_scaling(d.get("rope_scaling") or {}, where, max_pos)
    return dict(layer_types=tuple(types), rope_local_theta=local_theta, hidden_act=act, rope_theta=theta,
                rope_scaling=scaling, **caps,
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or d.get("head_dim") or 256))


def _rope_scaling(d: dict, where: str, max_position_embeddings: int, top_original: int | None = None,
                  aliases: bool = False) -> RopeScaling | None:
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if aliases:  # Phi-3's older names (only there: a Llama's "yarn" is YaRN, not supported)
        rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise FlotillaError(f"{where}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if rope_type == "longrope":
        return longrope(d, where, max_position_embeddings, top_original)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        # absent, transformers takes the model's max_position_embeddings
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", max_position_embeddings)),
    )


def longrope(d: dict, where: str, max_position_embeddings: int, top_original: int | None) -> RopeScaling:
    """Phi-3's longrope as transformers reads it: the original context from rope_scaling or the config's top level
    (else max_position_embeddings), factor given or the ratio of the two, attention_factor given or
    sqrt(1 + ln(factor) / ln(original)) past 1."""
    import math

    original = int(d.get("original_max_position_embeddings") or top_original or max_position_embeddings)
    factors = []
    for key in ("short_factor", "long_factor"):
        f = d.get(key)
        if not isinstance(f, list) or not f or not all(isinstance(x, (int, float)) and x > 0 for x in f):
            raise FlotillaError(f"{where}: longrope's {key} must be a list of positive numbers, one per frequency")
        factors.append(tuple(float(x) for x in f))
    if len(factors[0]) != len(factors[1]):
        raise FlotillaError(f"{where}: longrope's short_factor and long_factor differ in length "
                            f"({len(factors[0])}, {len(factors[1])})")
    factor = float(d.get("factor") or max_position_embeddings / original)
    attention = d.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=factors[0], long_factor=factors[1], attention_factor=float(attention))
