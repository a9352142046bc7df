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

import torch

from flotilla.errors import FlotillaError

from .checkpoint import INDEX_FILE, Manifest, is_checkpoint
from .config import MULTIMODAL_PREFIXES, ModelConfig
from .converted_source import converted
from .fused_names import split_fused
from .gguf_source import GGUFSource


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
        self._stored: dict[str, str] = {}  # our name -> the file's, where they differ
        if self.config.extra.get("multimodal"):
            self._text_model_names()

    def _text_model_names(self) -> None:
        """An image-text checkpoint (Gemma 3 4B and up): its language model's tensors under the text model's
        names, the vision tower's and the projector's left out."""
        kept = {}
        for name, file in self._weight_map.items():
            ours = next(("model." + name[len(p):] for p in MULTIMODAL_PREFIXES if name.startswith(p)), None)
            if ours is None and name in ("language_model.lm_head.weight", "lm_head.weight"):
                ours = "lm_head.weight"
            if ours is not None:
                kept[ours] = file
                self._stored[ours] = name
        if not any(n.startswith("model.layers.") for n in kept):
            raise FlotillaError(f"{self.path}: a {self.config.extra['multimodal']} checkpoint, but no tensor is named "
                                f"as its language model's ({' or '.join(p + '…' for p in MULTIMODAL_PREFIXES)})")
        self._weight_map = kept

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
                                    "only, since unpickling untrusted files runs code. If you trust the files, "
                                    "convert them once with transformers: python -c \"from transformers import "
                                    "AutoModelForCausalLM as M; M.from_pretrained('DIR').save_pretrained('OUT')\" "
                                    "(OUT gets safetensors; copy the tokenizer files beside them)")
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
            return self._open(file).get_tensor(self._stored.get(name, name))
        except FlotillaError:
            raise
        except Exception as e:
            raise FlotillaError(f"{self.path / file}: cannot read tensor {name!r} ({e}); the file may be truncated") from None


def open_source(path: str | Path, native_gguf: bool = True):
    """Open a model path of any supported kind, or raise a FlotillaError saying what is wrong.
    A GGUF file is opened `native` (its blocks kept) unless `native_gguf` is False (fp32)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FlotillaError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix == ".gguf" or _has_gguf_magic(p):
            return split_fused(GGUFSource(p, native=native_gguf))
        raise FlotillaError(f"{p}: not a model (expected a .gguf file or a model directory)")
    # AWQ and bitsandbytes layouts read as GPTQ tensors; Phi-3's fused q/k/v and gate/up under their own names
    return split_fused(converted(SafetensorsSource(p)))


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
