"""A GGUF file as a weight source (see flotilla.models.sources for the interface).

Tensor names are mapped to Hugging Face's and llama.cpp's q/k row permutation is undone. Opened
`native` (the runtime's way), quantized tensors come as their blocks, decoded into
flotilla.kernels.ggml's exact form straight from the file's bytes (models/gguf_file.py); otherwise (and for the
types without flotilla kernels) as fp32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight, decode, is_supported

from .config import GEMMA_ACT, GEMMA_FAMILIES, GGUFQuant, ModelConfig, RopeScaling, gemma_layer_types, longrope
from .gguf_file import GGUFFile, GGUFFormatError, TensorInfo

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # fused (models/fused_names.py)
# Gemma 3's four norms a layer: ffn_norm is the one before the MLP; the other two norm the attention's and the MLP's
# outputs. llama.cpp stores every Gemma norm weight as 1 + w: read back as transformers keeps them (w).
_GGUF_GEMMA3_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
_ROPE_TABLES = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # not weights
GGUF_DENSE_TYPES = ("F32", "F16", "BF16")  # unquantized: read as they are (fp32)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved rope pairs back to HF's rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A GGUF file, names mapped to Hugging Face's.

    `get(name)` gives any tensor dequantized to fp32 (what `quantize` reads). With `native` (the
    runtime's way), `config.quant` is GGUFQuant and `get_native(name)` gives a quantized tensor
    as a flotilla.kernels.ggml.GGMLWeight, decoded straight from the file's bytes (never through
    fp32), for the types flotilla has kernels for; other types come dequantized to fp32 (the
    load report of models/gguf_report.py warns about them)."""

    def __init__(self, path: str | Path, native: bool = True):
        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except (GGUFFormatError, OSError) as e:
            raise FlotillaError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.opened_files = [self.path.name]
        self.arch = self._field("general.architecture")
        if self.arch not in _GGUF_ARCHS:
            raise FlotillaError(f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
        experts = self._field(f"{self.arch}.expert_count", 0)
        if experts:  # Mixtral-style files say "llama" too; their expert tensors would be an unexplained name
            raise FlotillaError(f"{self.path}: a mixture-of-experts model ({experts} experts a layer, as Mixtral); "
                                "flotilla runs dense models only")
        self._tensors = {self._hf_name(t.name): t for t in self.file.tensors.values()}
        self.native = native
        config = self._config()
        self.config = config.with_quant(GGUFQuant()) if native else config

    def _field(self, key: str, default=None):
        return self.file.field(key, default)

    def _hf_name(self, name: str) -> str:
        if name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[name]
        parts = name.split(".")
        names = {**_GGUF_LAYER_NAMES, **{"phi3": _GGUF_PHI3_NAMES, "gemma3": _GGUF_GEMMA3_NAMES,
                                          "gemma2": _GGUF_GEMMA3_NAMES}.get(self.arch, {})}
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        if name in _ROPE_TABLES:
            return name
        raise FlotillaError(f"{self.path}: unexpected GGUF tensor {name!r}")

    def _config(self) -> ModelConfig:
        a = self.arch
        n_layers = self._field(f"{a}.block_count")
        hidden = self._field(f"{a}.embedding_length")
        heads = self._field(f"{a}.attention.head_count")
        if None in (n_layers, hidden, heads):
            raise FlotillaError(f"{self.path}: GGUF metadata lacks {a}.block_count/embedding_length/attention.head_count")
        kv_heads = self._field(f"{a}.attention.head_count_kv", heads)
        head_dim = self._field(f"{a}.attention.key_length", hidden // heads)
        vocab = self._field(f"{a}.vocab_size")
        if vocab is None:
            vocab = self.file.array_length("tokenizer.ggml.tokens")
        if vocab is None:
            raise FlotillaError(f"{self.path}: GGUF metadata has neither {a}.vocab_size nor tokenizer.ggml.tokens")
        eos = self._field("tokenizer.ggml.eos_token_id")
        eot = self._field("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        bad = [i for i in eos_ids if not 0 <= i < int(vocab)]
        if bad:
            raise FlotillaError(f"{self.path}: GGUF end-of-text token id {bad[0]} is outside the {int(vocab)}-token "
                                "vocabulary; the file's tokenizer metadata is corrupt")
        # as llama.cpp writes Mistral's: every layer's (a Gemma 2 file without it: llama.cpp's 4096)
        window = self._field(f"{a}.attention.sliding_window", 4096 if a == "gemma2" else None)
        gemma = self._gemma(int(n_layers), int(hidden), int(heads), int(head_dim)) if a in GEMMA_FAMILIES else {}
        return ModelConfig(**gemma,
            architecture=_GGUF_ARCHS[a],
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(n_layers),
            num_attention_heads=int(heads),
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._field(f"{a}.context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            qkv_bias=a == "qwen2",
            qk_norm=a in ("qwen3", "gemma3"),
            rope_scaling=self._rope_scaling(int(head_dim)),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype="float32",
            sliding_window=int(window) if window else None,
        )

    def _gemma(self, n_layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """Gemma 2 / 3's fields of ModelConfig as llama.cpp runs the file: every second (Gemma 3: sixth) layer
        global, or the file's sliding_window_pattern; Gemma 3's sliding layers' rope base 10000 (or
        rope.freq_base_swa); the attention scale 1 / sqrt(head_dim) but the 27Bs' (Gemma 2: 46 layers, Gemma 3: 62)
        1 / sqrt(hidden / heads), or the file's attention.scale; Gemma 2's soft-capping."""
        a = self.arch
        pattern = self._field(f"{a}.attention.sliding_window_pattern", 6 if a == "gemma3" else 2)
        if isinstance(pattern, (list, tuple)):  # one flag a layer: True where it slides
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = gemma_layer_types(n_layers, int(pattern))
        if len(types) != n_layers:
            raise FlotillaError(f"{self.path}: {a}.attention.sliding_window_pattern names {len(types)} layers of "
                                f"{n_layers}")
        scale = self._field(f"{a}.attention.scale")
        big = n_layers == (62 if a == "gemma3" else 46)
        scalar = 1.0 / float(scale) ** 2 if scale else float(hidden // heads if big else head_dim)
        # Gemma 2 files written before llama.cpp stored the caps: its defaults, 50 and 30
        defaults = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if a == "gemma2" else {}
        caps = {}
        for name, key in (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
            cap = self._field(f"{a}.{key}", defaults.get(key))
            caps[name] = float(cap) if cap else None
        local = float(self._field(f"{a}.rope.freq_base_swa", 10000.0)) if a == "gemma3" else None
        return dict(layer_types=tuple(types), rope_local_theta=local, query_pre_attn_scalar=scalar,
                    hidden_act=GEMMA_ACT, **caps)

    def _rope_scaling(self, head_dim: int) -> RopeScaling | None:
        a = self.arch
        kind = self._field(f"{a}.rope.scaling.type")
        dims = self._field(f"{a}.rope.dimension_count", head_dim)
        if dims != head_dim:
            raise FlotillaError(f"{self.path}: rope over {dims} of each head's {head_dim} dimensions (a partial "
                                "rotary, as Phi-4-mini's) is not supported; flotilla rotates whole heads")
        if "rope_factors_long.weight" in self._tensors:
            return self._longrope(head_dim)
        if "rope_freqs.weight" in self._tensors:
            return self._llama3_from_rope_freqs(head_dim)
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(self._field(f"{a}.rope.scaling.factor", 1.0)))
        raise FlotillaError(f"{self.path}: GGUF rope scaling type {kind!r} is not supported (none, linear, llama3)")

    def _longrope(self, head_dim: int) -> RopeScaling:
        """Phi-3's longrope as llama.cpp stores it: the factors as two tensors, the attention factor and the
        original context as metadata."""
        a = self.arch
        factors = {}
        for which in ("short", "long"):
            name = f"rope_factors_{which}.weight"
            if name not in self._tensors:
                raise FlotillaError(f"{self.path}: rope_factors_long.weight without {name}")
            factors[which] = [float(x) for x in np.array(self._dequant(self._tensors[name])).flatten()]
        context = int(self._field(f"{a}.context_length", 2048))
        original = self._field(f"{a}.rope.scaling.original_context_length", context)
        attention = self._field(f"{a}.rope.scaling.attn_factor")
        scaling = longrope({"short_factor": factors["short"], "long_factor": factors["long"],
                            "original_max_position_embeddings": int(original),
                            **({"attention_factor": float(attention)} if attention is not None else {})},
                           str(self.path), context, None)
        if len(scaling.short_factor) != head_dim // 2:
            raise FlotillaError(f"{self.path}: {len(scaling.short_factor)} rope factors for {head_dim // 2} "
                                "frequencies a head")
        return scaling

    def _llama3_from_rope_freqs(self, head_dim: int) -> RopeScaling:
        # llama.cpp stores Llama 3.1's scaling as per-frequency divisors; recover the parameters
        # by checking them against the standard llama3 recipe.
        from .rope import llama3_freq_factors

        stored = torch.from_numpy(np.array(self._dequant(self._tensors["rope_freqs.weight"]))).float().flatten()
        a = self.arch
        orig = int(self._field(f"{a}.rope.scaling.original_context_length", 8192))
        factor = float(self._field(f"{a}.rope.scaling.factor", 8.0))
        theta = float(self._field(f"{a}.rope.freq_base", 10000.0))
        scaling = RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=orig)
        expected = llama3_freq_factors(head_dim, theta, scaling)
        if stored.shape != expected.shape or not torch.allclose(stored, expected, rtol=1e-3):
            raise FlotillaError(f"{self.path}: rope_freqs.weight does not match the llama3 rope recipe; "
                                "this rope scaling is not supported")
        return scaling

    def names(self) -> list[str]:
        return [n for n in self._tensors if n not in _ROPE_TABLES]

    def release(self) -> None:
        """Nothing to release: each tensor is read with one positional read, and nothing is mapped."""

    def type_of(self, name: str) -> str:
        """The GGUF type name of tensor `name` (Q4_K, F32, …)."""
        return self._tensor(name).type_name

    def quantized_types(self) -> list[str]:
        """The quantized GGUF types of the file's tensors, sorted."""
        return sorted({self.type_of(n) for n in self.names()} - set(GGUF_DENSE_TYPES))

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise FlotillaError(f"{self.path}: tensor {name!r} is missing")
        return t

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose llama.cpp row permutation `name` carries, or None."""
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            return self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
        return None

    def _dequant(self, t: TensorInfo) -> np.ndarray:
        import gguf

        qtype = gguf.GGMLQuantizationType(t.type)
        try:
            return gguf.quants.dequantize(self.file.read(t), qtype)
        except NotImplementedError:
            raise FlotillaError(f"{self.path}: tensor {t.name!r} has GGUF type {qtype.name}, which flotilla cannot "
                                f"read; supported: {', '.join(GGUF_DENSE_TYPES + tuple(GGML_FORMATS))} natively, "
                                "and most other llama.cpp types through fp32") from None
        except Exception as e:
            raise FlotillaError(f"{self.path}: cannot decode tensor {t.name!r} of type {qtype.name} ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` in fp32."""
        t = self._tensor(name)
        w = np.ascontiguousarray(self._dequant(t), dtype=np.float32)
        shape = t.shape
        w = w.reshape(shape) if w.size == int(np.prod(shape)) else w
        heads = self._permuted_heads(name)
        if heads is not None:
            w = _unpermute(w, heads)
        if self.arch in GEMMA_FAMILIES and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's 1 + w back to the checkpoint's w (models/llama.RMSNorm adds the 1)
        return torch.from_numpy(np.array(w, copy=True, order="C"))

    def get_native(self, name: str) -> GGMLWeight | torch.Tensor:
        """Tensor `name` as the runtime's GGUF layers take it: a GGMLWeight for the types with
        flotilla kernels, else fp32 (`get`). Without `native`, always `get`."""
        t = self._tensor(name)
        qtype = self.type_of(name)
        if not self.native or not is_supported(qtype):
            return self.get(name)
        shape = t.shape
        if len(shape) != 2:
            raise FlotillaError(f"{self.path}: tensor {name!r} of type {qtype} has shape {shape}; expected a matrix")
        try:
            w = decode(self.file.read(t), qtype, *shape)
        except ValueError as e:
            raise FlotillaError(f"{self.path}: tensor {name!r}: {e}") from None
        heads = self._permuted_heads(name)
        if heads is not None:
            w = w.take_rows(torch.from_numpy(_unpermute(np.arange(shape[0]), heads)))
        return w
