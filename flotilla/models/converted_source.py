"""Community checkpoints whose linears are stored in another tool's layout, read as GPTQ tensors.

    AutoAWQ (quant_method "awq", GEMM)        4-bit, its group size      models/awq_layout.py
    bitsandbytes 4-bit (NF4, FP4, nested)     INT8, a group per block    models/bnb_layout.py
    bitsandbytes 8-bit (LLM.int8)             INT8 per output channel    models/bnb_layout.py

`converted(source)` wraps a Hugging Face directory of one of these: its config's quant says the
GPTQ form the runtime builds (QuantLinear, zeros stored as they are: gptq_v2), its names are
those of a GPTQ checkpoint (`P.qweight`, `P.qzeros`, `P.scales`, `P.g_idx`), and `get` converts
one projection when one of its tensors is asked for (the loader asks for a projection's four in
a row; the last conversion is kept for the next three). Linears the file keeps in float (the
tool's skipped modules) become "-:" entries of the quant's `dynamic`, so they load as plain
linears. Everything else is read from the wrapped source unchanged.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.gptq import GPTQWeight

from . import awq_layout, bnb_layout
from .config import QuantConfig
from .fused_names import fused_prefix
from .weights import required_tensor_names

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def community_quant(d: dict[str, Any], where: str) -> QuantConfig:
    """The GPTQ form of an AutoAWQ or bitsandbytes `quantization_config` (module docstring)."""
    method = d["quant_method"]
    if method == "awq":
        version = str(d.get("version", "gemm")).lower()
        bits, group = d.get("bits", d.get("w_bit")), int(d.get("group_size", d.get("q_group_size", 128)))
        if version != "gemm" or bits != 4 or not d.get("zero_point", True):
            raise FlotillaError(f"{where}: AWQ version {version!r}, {bits!r} bits, zero_point "
                                f"{d.get('zero_point', True)!r}; flotilla reads AutoAWQ's GEMM layout: 4 bits with "
                                "zero points")
        return QuantConfig(bits=4, group_size=group, sym=False, checkpoint_format="awq", method="awq")
    if d.get("load_in_4bit"):
        kind = d.get("bnb_4bit_quant_type", "fp4")
        if kind not in ("nf4", "fp4"):
            raise FlotillaError(f"{where}: bnb_4bit_quant_type {kind!r}; expected nf4 or fp4")
        # the group is each tensor's blocksize: the source sets it from the file (64 as transformers saves)
        return QuantConfig(bits=8, group_size=64, checkpoint_format="bitsandbytes", method=f"bitsandbytes-{kind}")
    if d.get("load_in_8bit"):
        return QuantConfig(bits=8, group_size=-1, checkpoint_format="bitsandbytes", method="bitsandbytes-int8")
    raise FlotillaError(f"{where}: a bitsandbytes quantization_config with neither load_in_4bit nor load_in_8bit")


def converted(source):
    """`source` itself, or a ConvertedSource when its linears are stored in a community layout."""
    quant = source.config.quant
    if isinstance(quant, QuantConfig) and quant.checkpoint_format in ("awq", "bitsandbytes"):
        return ConvertedSource(source)
    return source


class ConvertedSource:
    def __init__(self, inner):
        self.inner, self.path = inner, inner.path
        quant = inner.config.quant
        raw = set(inner.names())
        if quant.checkpoint_format == "awq":
            self._stored = awq_layout.stored(raw)
        elif quant.method == "bitsandbytes-int8":
            self._stored = bnb_layout.stored_8bit(raw)
        else:
            self._stored = bnb_layout.stored_4bit(raw)
        if not self._stored:
            raise FlotillaError(f"{self.path}: config.json says {quant.method}, but no tensor is stored that way")
        if "lm_head" in self._stored:
            raise FlotillaError(f"{self.path}: lm_head is stored {quant.method}; flotilla runs a float lm_head only")
        if quant.method.startswith("bitsandbytes-") and quant.group_size != -1:  # 4-bit: the blocksize of the file
            first = min(self._stored)
            quant = dataclasses.replace(quant, group_size=bnb_layout.Bnb4State.read(inner.get, first, raw).blocksize)
        self._raw, self._quant = raw, quant
        wanted = {fused_prefix(inner.config, n.removesuffix(".qweight"))  # (Phi-3: as its file names them)
                  for n in required_tensor_names(inner.config.with_quant(quant)) if n.endswith(".qweight")}
        floats = sorted(p for p in wanted - self._stored if p + ".weight" in raw)  # the tool's skipped modules
        dynamic = tuple((f"-:{re.escape(p)}$", ()) for p in floats)
        self.config = inner.config.with_quant(dataclasses.replace(quant, dynamic=quant.dynamic + dynamic))
        own = {n for n in raw if _projection(n) in self._stored}  # the layout's tensors (and biases)
        self._names = sorted(raw - own | {f"{p}.{s}" for p in self._stored for s in GPTQ_SUFFIXES}
                             | {n for n in own if n.endswith(".bias")})
        self._last: tuple[str, GPTQWeight] | None = None

    def __getattr__(self, name: str):  # opened_files, manifest, file_of, ...: the wrapped source's
        return getattr(self.inner, name)

    def names(self) -> list[str]:
        return list(self._names)

    def release(self) -> None:
        self.inner.release()

    def get(self, name: str) -> torch.Tensor:
        prefix, suffix = name.rsplit(".", 1)
        if prefix not in self._stored or suffix not in GPTQ_SUFFIXES:
            return self.inner.get(name)
        if self._last is None or self._last[0] != prefix:
            self._last = (prefix, self._convert(prefix))
        return getattr(self._last[1], suffix)

    def _convert(self, prefix: str) -> GPTQWeight:
        quant = self._quant
        try:
            if quant.checkpoint_format == "awq":
                return awq_layout.read(self.inner.get, prefix, quant.group_size)
            if quant.method == "bitsandbytes-int8":
                return bnb_layout.read_8bit(self.inner.get, prefix, self._raw)
            w = bnb_layout.read_4bit(self.inner.get, prefix, self._raw)
            if w.group_size != quant.group_size:
                raise FlotillaError(f"blocksize {w.group_size}, where the other projections have {quant.group_size}")
            return w
        except FlotillaError as e:
            raise FlotillaError(f"{self.path}: {prefix}: {e}") from None


def _projection(name: str) -> str:
    """`model.layers.0.mlp.up_proj` of any of its tensors: .qweight, .SCB, .weight.absmax, .weight.quant_state.x"""
    head, sep, _ = name.partition(".weight.")
    return head if sep else name.rsplit(".", 1)[0]
