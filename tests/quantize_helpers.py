"""Helpers of the quantize tests: tiny models with a byte-level tokenizer, CLI subprocesses, and an
independent reader of safetensors files and of the GPTQ layout (written from the format
descriptions, sharing no code with flotilla)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import make_hf_model, save_hf_model, tiny_config

REPO = Path(__file__).resolve().parent.parent
BOS, EOS = 256, 257


def byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer without merges: ids 0-255 are bytes, 256 <s>, 257 </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def tiny_model_dir(directory: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A random-weight Llama HF directory whose every linear input is a multiple of 128."""
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320, bos_token_id=BOS, eos_token_id=EOS)
    base.update(overrides)
    save_hf_model(make_hf_model(tiny_config("llama", **base), seed=seed), directory)
    if tokenizer:
        byte_tokenizer(directory)
    return directory


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(module: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=cli_env(), timeout=timeout)


def quantize_cli(*args, **kw) -> subprocess.CompletedProcess:
    return run_cli("flotilla.quantize.cli", *args, **kw)


# ------------------------------------------------------------------ an independent safetensors reader

_DTYPES = {"I32": np.int32, "F16": np.float16, "F32": np.float32, "BF16": np.uint16}  # bf16 as raw bits


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Parse a .safetensors file by its specification: an 8-byte little-endian header length, a
    JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def read_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(read_safetensors(directory / file))
    return tensors


def decode_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray,
                bits: int) -> np.ndarray:
    """W [in, out] from the GPTQ ("gptq"/v1) tensors, straight from the format description:
    qweight packs 32/bits consecutive input rows into each int32, lowest bits first; qzeros packs
    32/bits consecutive output columns the same way and stores zero - 1; W = s * (q - z)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    words = qweight.astype(np.int64) & 0xFFFFFFFF  # unsigned
    rows, out = words.shape
    q = np.empty((rows * per, out), dtype=np.int64)
    for j in range(per):
        q[j::per] = (words >> (bits * j)) & mask
    zwords = qzeros.astype(np.int64) & 0xFFFFFFFF
    groups = zwords.shape[0]
    z = np.empty((groups, zwords.shape[1] * per), dtype=np.int64)
    for j in range(per):
        z[:, j::per] = ((zwords >> (bits * j)) & mask) + 1
    g = g_idx.astype(np.int64)
    return (q - z[g]).astype(np.float32) * scales.astype(np.float32)[g]
