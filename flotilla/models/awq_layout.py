"""AutoAWQ's GEMM layout (quant_method "awq", version "gemm"), read into the GPTQ layout.

Per projection P, as AutoAWQ's WQLinear_GEMM writes it (4 bits, zero points on):

    P.qweight  int32 [in, out / 8]       row i, word j: outputs 8j..8j+7, output 8j + ORDER[k] in
                                         bits [4k, 4k + 4), ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    P.qzeros   int32 [in / group, out / 8]  the zero points, packed the same way
    P.scales   fp16  [in / group, out]

    W[i, o] = (q[i, o] - zero[i // group, o]) * scales[i // group, o]

The codes are repacked along the input axis and the zeros kept as they are (GPTQModel's gptq_v2
convention: an AWQ zero may be 0, which the gptq format cannot store): every weight decodes to
the same value, and the checkpoint runs in flotilla's W4 kernels unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight, default_g_idx

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds output 8j + ORDER[k]


def stored(names: set[str]) -> set[str]:
    return {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's order -> codes int32 [rows, cols]."""
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 15  # [rows, words, 8]: nibble k
    codes = torch.empty_like(nibbles)
    codes[:, :, list(ORDER)] = nibbles  # output 8j + ORDER[k] <- nibble k
    return codes.view(rows, words * 8)


def read(get: Callable[[str], torch.Tensor], prefix: str, group_size: int) -> GPTQWeight:
    """Projection `prefix` as a 4-bit GPTQ weight with zeros stored as they are."""
    qweight, qzeros, scales = get(prefix + ".qweight"), get(prefix + ".qzeros"), get(prefix + ".scales")
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    groups = in_f // group_size if group_size != -1 else 1
    expected = {"qweight": ((in_f, out_f // 8), torch.int32), "qzeros": ((groups, out_f // 8), torch.int32),
                "scales": ((groups, out_f), torch.float16)}
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        shape, dtype = expected[name]
        if tuple(t.shape) != shape or t.dtype != dtype or (group_size != -1 and in_f % group_size):
            raise FlotillaError(f"tensor {prefix}.{name}: {t.dtype} {list(t.shape)}; the AWQ GEMM layout at group "
                                f"{group_size} needs {dtype} {list(shape)} (inputs a multiple of the group)")
    return GPTQWeight.from_codes(unpack_awq(qweight), unpack_awq(qzeros), scales, default_g_idx(in_f, group_size),
                                 4, group_size, zero_offset=0)
