"""Random GGUF blocks, packed by hand (gguf has no quantizer for the K types)."""
from __future__ import annotations

import numpy as np

from flotilla.kernels.ggml import GGML_FORMATS, GGMLWeight, decode

FP16_FIELDS = {  # byte offsets of each type's fp16 fields (d, and m/dmin)
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [rows, row bytes] of random blocks, packed by hand: every code, scale and
    high-bit field random, the fp16 fields random finite values of either sign (zeros, subnormals
    and large ones included)."""
    fmt = GGML_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    n = rows * cols // fmt.block
    blocks = rng.integers(0, 256, (n, fmt.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)).astype(np.float16)
        vals[:3] = np.array([0.0, 6e-8, -65504.0], dtype=np.float16)[: min(3, n)]  # zero, subnormal, the largest
        blocks[:, off:off + 2] = vals.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def random_weight(qtype: str, rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> GGMLWeight:
    """A decoded random weight; `scale` < 1 keeps the fp16 fields small (values of a real model)."""
    raw = random_blocks(qtype, rows, cols, seed)
    if scale != 1.0:
        fmt = GGML_FORMATS[qtype]
        blocks = raw.reshape(-1, fmt.type_size)
        for off in FP16_FIELDS[qtype]:
            field = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16)
            small = (np.clip(field.astype(np.float32), -1, 1) * scale).astype(np.float16)
            blocks[:, off:off + 2] = small.view(np.uint8).reshape(-1, 2)
    return decode(raw, qtype, rows, cols)


MIXED_TYPES = {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q5_1", "ffn_gate": "Q4_1", "ffn_up": "Q5_0",
               "ffn_down": "Q8_0", "attn_output": "Q4_1", "token_embd": "Q8_0", "output": "Q4_0"}


def mixed_gguf(tmp_path, tied: bool = False, seed: int = 4, **config):
    """A tiny Llama GGUF whose q, k and v (and gate/up) are of different types, as in Q4_K_M files
    (gguf's own quantizer, MIXED_TYPES), the norms F32."""
    import gguf

    from conftest import make_hf_model, tiny_config, write_llama_gguf

    hf = make_hf_model(tiny_config("llama", tie_word_embeddings=tied, **config), seed=seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    plain = write_llama_gguf(hf, tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(str(plain))
    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        kind = MIXED_TYPES.get(t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0])
        data = np.array(t.data)
        if kind is not None:
            qt = gguf.GGMLQuantizationType[kind]
            w.add_tensor(t.name, gguf.quants.quantize(data.reshape(tuple(reversed(t.shape.tolist()))), qt),
                         raw_dtype=qt)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
