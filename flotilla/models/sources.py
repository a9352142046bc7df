"""Read weights from a Hugging Face directory, a flotilla checkpoint or a GGUF file.

Every source exposes the same small interface, with tensors named as in Hugging Face Llama
checkpoints (`model.layers.3.self_attn.q_proj.weight`, or `...q_proj.qweight` for GPTQ):

    source.config            ModelConfig
    source.names()           every tensor name
    source.get(name)         one tensor (read on demand; only its shard file is opened)
    source.opened_files      the files opened so far (tests use it)
    source.release()         close open files between reads of a streaming reader

Loading a layer range asks only for that range's names, so only the shards holding them are
opened, and for flotilla checkpoints only those are verified.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from flotilla.errors import FlotillaError

from .checkpoint import INDEX_FILE, Manifest, is_checkpoint
from .config import ModelConfig, RopeScaling


class SafetensorsSource:
    """A Hugging Face directory (one model.safetensors or shards with an index) or a flotilla
    checkpoint (the same, plus flotilla.json, whose sizes and hashes are checked per shard)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = ModelConfig.from_hf_dir(self.path)
        self.manifest = Manifest.read(self.path) if is_checkpoint(self.path) else None
        self._handles: dict[str, object] = {}
        self._verified: set[str] = set()
        self.opened_files: list[str] = []
        self._weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise FlotillaError(f"{index}: malformed index ({e})") from None
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
                raise FlotillaError(f"{self.path}: only pickle weights (.bin/.pt) found; flotilla reads safetensors "
                                    "only, since unpickling untrusted files runs code")
            raise FlotillaError(f"{self.path}: no .safetensors weights found")
        if len(files) > 1:
            raise FlotillaError(f"{self.path}: several .safetensors files but no {INDEX_FILE}")
        return {name: files[0].name for name in self._open(files[0].name).keys()}

    def _open(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            path = self.path / file
            if self.manifest is not None and file not in self._verified:
                self.manifest.verify(self.path, file)
                self._verified.add(file)
            if not path.is_file():
                raise FlotillaError(f"{path}: shard listed in the index is missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise FlotillaError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[file] = handle
            if file not in self.opened_files:
                self.opened_files.append(file)
        return handle

    def release(self) -> None:
        """Close the open files (unmapping them); later reads reopen them. A streaming reader
        calls this between layers so the pages it has read do not pile up in its memory."""
        self._handles.clear()

    def names(self) -> list[str]:
        return list(self._weight_map)

    def file_of(self, name: str) -> str:
        return self._weight_map[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise FlotillaError(f"{self.path}: tensor {name!r} is missing")
        file = self._weight_map[name]
        try:
            return self._open(file).get_tensor(name)
        except FlotillaError:
            raise
        except Exception as e:
            raise FlotillaError(f"{self.path / file}: cannot read tensor {name!r} ({e}); the file may be truncated") from None


# ---------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved rope pairs back to HF's rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A GGUF file: tensors dequantized to fp32 on demand, names mapped to Hugging Face's."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise FlotillaError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.opened_files = [self.path.name]
        self.arch = self._field("general.architecture")
        if self.arch not in _GGUF_ARCHS:
            raise FlotillaError(f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
        self._tensors = {}
        for t in self.reader.tensors:
            self._tensors[self._hf_name(t.name)] = t
        self.config = self._config()

    def _field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _hf_name(self, name: str) -> str:
        if name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[name]
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
        if name == "rope_freqs.weight":
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
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = self._field("tokenizer.ggml.eos_token_id")
        eot = self._field("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        return ModelConfig(
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
            rope_scaling=self._rope_scaling(int(head_dim)),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype="float32",
        )

    def _rope_scaling(self, head_dim: int) -> RopeScaling | None:
        a = self.arch
        kind = self._field(f"{a}.rope.scaling.type")
        if "rope_freqs.weight" in self._tensors:
            return self._llama3_from_rope_freqs(head_dim)
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(self._field(f"{a}.rope.scaling.factor", 1.0)))
        raise FlotillaError(f"{self.path}: GGUF rope scaling type {kind!r} is not supported (none, linear, llama3)")

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
        return [n for n in self._tensors if n != "rope_freqs.weight"]

    def release(self) -> None:
        """Nothing to close: the GGUF reader maps the (already compact) file once."""

    def _dequant(self, t) -> np.ndarray:
        import gguf

        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in GGUF_SUPPORTED_TYPES:
            raise FlotillaError(f"{self.path}: tensor {t.name!r} has GGUF type {qtype.name}, which is not supported; "
                                f"supported: {', '.join(GGUF_SUPPORTED_TYPES)}")
        try:
            return gguf.quants.dequantize(t.data, qtype)
        except Exception as e:
            raise FlotillaError(f"{self.path}: cannot decode tensor {t.name!r} of type {qtype.name} ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise FlotillaError(f"{self.path}: tensor {name!r} is missing")
        w = np.ascontiguousarray(self._dequant(t), dtype=np.float32)
        # GGUF stores dims innermost-first; the dequantized array is already [out, in].
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = w.reshape(shape) if w.size == int(np.prod(shape)) else w
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            w = _unpermute(w, heads)
        return torch.from_numpy(np.array(w, copy=True, order="C"))


def open_source(path: str | Path):
    """Open a model path of any supported kind, or raise a FlotillaError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FlotillaError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix == ".gguf" or _has_gguf_magic(p):
            return GGUFSource(p)
        raise FlotillaError(f"{p}: not a model (expected a .gguf file or a model directory)")
    return SafetensorsSource(p)


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
