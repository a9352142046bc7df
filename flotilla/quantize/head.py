"""`quantize --lm-head-bits B`: the output projection quantized too, so a decode step reads the
largest single matrix of a model (llama-3-8b: 128256 x 4096, 1 GB in fp16) at B bits.

Round to nearest on the weight-error grid (`mse`), one group per `group_size` inputs as the
decoder's linears: the head sees every token's final hidden state, so there is no calibration
Hessian worth the cost of GPTQ for it, and at 8 bits RTN is within noise of the fp16 head. The
rows go in chunks, so no fp32 copy of the whole vocabulary is made. Written as GPTQModel writes a
quantized head: `lm_head.qweight/qzeros/scales/g_idx`, `quantization_config.lm_head: true`, and
the head's bits in a `dynamic` entry where they differ from the body's (flotilla.models.config)."""
from __future__ import annotations

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight
from flotilla.models.checkpoint import gptq_tensors
from flotilla.models.config import ModelConfig

from .grid import GridSpec, rtn_quantize

HEAD_PATTERN = r"+:^lm_head$"
ROWS = 8192  # vocabulary rows a chunk (a multiple of every packing's 32 / bits)


def head_dynamic(head_bits: int, bits: int) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """The `dynamic` entry that gives the head its bits (none when they are the body's). It goes
    first: the first matching pattern decides, so no --keep pattern can claim the head."""
    return () if head_bits == bits else ((HEAD_PATTERN, (("bits", head_bits),)),)


def check_head(cfg: ModelConfig, head_bits: int, where: str) -> None:
    per_word = 32 // head_bits
    bad = [n for n in (cfg.hidden_size, cfg.vocab_size) if n % per_word]
    if bad:
        raise FlotillaError(f"{where}: the lm_head has a dimension of {bad[0]}, not a multiple of {per_word}, which "
                            f"--lm-head-bits {head_bits} packing needs; leave the head in fp16 (no --lm-head-bits)")


def head_tensors(weight: torch.Tensor, head_bits: int, group_size: int, sym: bool,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of the head `weight` [vocab, hidden] (the embedding where the source ties them)."""
    spec = GridSpec(head_bits, sym, "mse")
    parts = [rtn_quantize(weight[r:r + ROWS].to(device=device, dtype=torch.float32), spec, group_size).to_gptq()
             for r in range(0, weight.shape[0], ROWS)]
    first = parts[0]
    whole = GPTQWeight(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.qzeros for p in parts], dim=1),
                       torch.cat([p.scales for p in parts], dim=1), first.g_idx, head_bits, group_size,
                       first.zero_offset)  # chunks of output columns: every [.., out] tensor joins on dim 1
    return gptq_tensors("lm_head", whole)
