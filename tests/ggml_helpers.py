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
