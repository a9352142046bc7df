"""Write a GPTQ-layout checkpoint by round-to-nearest quantization of any model source.

    python3 bench/rtn_checkpoint.py SOURCE OUT [--bits 4] [--group-size 64] [--asym]

A benchmark helper (the real pipeline is `quantize`): every decoder linear is quantized per
group with RTN and packed with GPTQWeight.from_codes, everything else is copied, and the result
is written with the checkpoint module's CheckpointWriter, so `load_model(OUT)` reads it like
any flotilla checkpoint. SOURCE is a GGUF file (e.g. the default SmolLM2 Q4_1) or a HF directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.kernels.gptq import GPTQWeight, default_g_idx  # noqa: E402
from flotilla.models.checkpoint import CheckpointWriter, layer_key  # noqa: E402
from flotilla.models.config import QuantConfig  # noqa: E402
from flotilla.models.sources import open_source  # noqa: E402
from flotilla.models.tokenizer import load_tokenizer  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> GPTQWeight:
    """An nn.Linear weight [out, in] -> GPTQ tensors, round to nearest per group of inputs."""
    w = weight.to(torch.float32).t().contiguous()  # [in, out]
    k, n = w.shape
    gs = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    groups = w.view(k // gs, gs, n)  # [G, gs, out]
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)  # [G, out]
    if sym:
        amax = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-8)
        scales = 2 * amax / maxq
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(1, maxq)  # the gptq format stores zero - 1 >= 0
    scales = scales.half().float()  # what the checkpoint stores
    q = torch.round(groups / scales[:, None, :]) + zeros[:, None, :]
    q = q.clamp(0, maxq).to(torch.int32).view(k, n)
    return GPTQWeight.from_codes(q, zeros.to(torch.int32), scales, default_g_idx(k, group_size), bits, group_size)


def write_rtn_checkpoint(source_path: str | Path, out: str | Path, bits: int = 4, group_size: int = 64,
                         sym: bool = True, force: bool = False) -> Path:
    source = open_source(source_path)
    config = source.config.with_quant(QuantConfig(bits=bits, group_size=group_size, sym=sym, method="rtn"))
    by_layer: dict[str, list[str]] = {}
    for name in source.names():
        by_layer.setdefault(layer_key(name), []).append(name)
    order = ["embed"] + [str(i) for i in range(config.num_hidden_layers)] + ["head"]
    with CheckpointWriter(out, config, force=force) as writer:
        for key in order:
            tensors = {}
            for name in by_layer.get(key, []):
                module, _, suffix = name.rpartition(".")
                if suffix == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                    w = rtn_quantize(source.get(name), bits, group_size, sym)
                    for field in ("qweight", "qzeros", "scales", "g_idx"):
                        tensors[f"{module}.{field}"] = getattr(w, field)
                else:
                    tensors[name] = source.get(name)
            writer.add_layer(key, tensors)
        load_tokenizer(source_path, config.eos_token_ids).save(writer.tmp)
        return writer.commit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    path = write_rtn_checkpoint(args.source, args.out, args.bits, args.group_size, not args.asym, args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
