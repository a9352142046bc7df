"""Checkpoints that store a layer's q/k/v, and its gate/up, each as one fused tensor.

Phi-3's checkpoints do so (`self_attn.qkv_proj`, `mlp.gate_up_proj`, as transformers, vLLM and GPTQModel write
them; llama.cpp's `attn_qkv` and its `ffn_up` that holds gate then up). The rest of flotilla names each projection
apart (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, then merges them into one linear itself), so:

    split_fused(source)       reads such a checkpoint under the split names: `get` slices the fused tensor
    fuse_tensors(config, d)   writes a layer's split tensors back under the fused names (CheckpointWriter)

A fused tensor is cut along its outputs: rows of a float `weight` or `bias` (and of a GGUF weight's blocks),
columns of GPTQ's `qweight` and `scales`, columns of `qzeros` in packed words; `g_idx` is the input's, shared.
"""
from __future__ import annotations

import torch

from flotilla.errors import FlotillaError

from .config import FUSED, FUSED_FAMILIES, ModelConfig
COLUMNS = ("qweight", "scales", "qzeros")  # GPTQ tensors whose columns are the outputs ([in / pack, out], …)


def stores_fused(config: ModelConfig) -> bool:
    return config.family in FUSED_FAMILIES


def part_sizes(config: ModelConfig, fused: str) -> tuple[int, ...]:
    """The outputs of each projection of `fused` (a key of FUSED), in order."""
    if fused == "self_attn.qkv_proj":
        return config.q_size, config.kv_size, config.kv_size
    return config.intermediate_size, config.intermediate_size


def _split_name(name: str) -> tuple[str, str, str] | None:
    """(layer prefix, fused projection, suffix) of a fused tensor's name, else None."""
    for fused in FUSED:
        marker = f".{fused}."
        if marker in name:
            prefix, suffix = name.split(marker, 1)
            return prefix, fused, suffix
    return None


def _pack(config: ModelConfig, prefix: str, fused: str) -> int:
    """Outputs per packed qzeros word of the linear `fused` of layer `prefix` (32 / bits)."""
    quant = config.linear_quant(prefix + ".", FUSED[fused])
    bits = getattr(quant, "bits", None)
    if bits is None:
        raise FlotillaError(f"{prefix}.{fused}: GPTQ tensors where the config says the linear is not GPTQ-quantized")
    return 32 // bits


def _cut(t, suffix: str, start: int, size: int, pack: int):
    if suffix == "g_idx":
        return t
    if suffix in COLUMNS:
        if suffix == "qzeros":
            if start % pack or size % pack:
                raise FlotillaError(f"a projection of {size} outputs at {start} does not start and end on a word "
                                    f"of packed zeros ({pack} a word); split them in the checkpoint")
            start, size = start // pack, size // pack
        return t[:, start:start + size].contiguous()
    if hasattr(t, "take_rows"):  # a GGUF weight's blocks (flotilla.kernels.ggml.GGMLWeight)
        return t.take_rows(torch.arange(start, start + size))
    return t[start:start + size].contiguous()


class SplitSource:
    """A source whose fused tensors read as their projections (module docstring); any other name passes through."""

    def __init__(self, inner):
        self.inner, self.path, self.config = inner, inner.path, inner.config
        self._parts: dict[str, tuple[str, int, int, str, str, str]] = {}  # split name -> where it lies
        names = []
        for name in inner.names():
            found = _split_name(name)
            if found is None:
                names.append(name)
                continue
            prefix, fused, suffix = found
            start = 0
            for proj, size in zip(FUSED[fused], part_sizes(self.config, fused)):
                split = f"{prefix}.{proj}.{suffix}"
                self._parts[split] = (name, start, size, suffix, prefix, fused)
                names.append(split)
                start += size
        self._names = names
        # the fused tensors of the layer read last (the loader asks for a layer's items projection by projection,
        # each suffix in turn: every fused tensor is read once)
        self._layer: str | None = None
        self._read_tensors: dict[tuple[str, bool], object] = {}

    def __getattr__(self, name: str):  # opened_files, manifest, file_of, type_of, ...: the wrapped source's
        return getattr(self.inner, name)

    def names(self) -> list[str]:
        return list(self._names)

    def unwrapped(self):
        """The source this one reads from (a GGUFSource, a SafetensorsSource, …)."""
        return self.inner

    def type_of(self, name: str) -> str:
        """A GGUF source's type of `name`: its fused tensor's for a part of one."""
        where = self._parts.get(name)
        return self.inner.type_of(where[0] if where else name)

    def release(self) -> None:
        self._layer, self._read_tensors = None, {}
        self.inner.release()

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, native=False)

    def get_native(self, name: str):
        return self._read(name, native=True)

    def _read(self, name: str, native: bool):
        read = getattr(self.inner, "get_native", self.inner.get) if native else self.inner.get
        where = self._parts.get(name)
        if where is None:
            return read(name)
        fused_name, start, size, suffix, prefix, fused = where
        if prefix != self._layer:
            self._layer, self._read_tensors = prefix, {}
        whole = self._read_tensors.get((fused_name, native))
        if whole is None:
            whole = self._read_tensors[(fused_name, native)] = read(fused_name)
        total = sum(part_sizes(self.config, fused))
        pack = _pack(self.config, prefix, fused) if suffix == "qzeros" else 1
        rows = whole.shape[1] * (pack if suffix == "qzeros" else 1) if suffix in COLUMNS else whole.shape[0]
        if suffix != "g_idx" and rows != total:
            raise FlotillaError(f"{self.path}: tensor {fused_name!r} has {rows} outputs where the config's "
                                f"{' + '.join(str(s) for s in part_sizes(self.config, fused))} = {total} were expected")
        return _cut(whole, suffix, start, size, pack)


def unwrapped(source):
    """The source under a SplitSource, or `source`."""
    return source.unwrapped() if isinstance(source, SplitSource) else source


def fused_prefix(config: ModelConfig, projection: str) -> str:
    """The checkpoint module `projection` (model.layers.0.self_attn.q_proj) is stored in: its fused one in a family
    that stores fused tensors, else itself."""
    if stores_fused(config):
        for fused, parts in FUSED.items():
            for part in parts:
                if projection.endswith("." + part):
                    return projection[: -len(part)] + fused
    return projection


def split_fused(source):
    """`source` itself, or a SplitSource where its family stores fused projections."""
    return SplitSource(source) if stores_fused(source.config) else source


def fuse_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's tensors with each fused group's projections joined under the fused name, for a family that stores
    them so (others: `tensors` as they are). Every projection of a group must be there, with one g_idx."""
    if not stores_fused(config):
        return tensors
    out, groups = {}, {}
    owner = {proj: fused for fused, projs in FUSED.items() for proj in projs}
    for name, t in tensors.items():
        for proj, fused in owner.items():
            marker = f".{proj}."
            if marker in name:
                prefix, suffix = name.split(marker, 1)
                groups.setdefault((prefix, fused, suffix), {})[proj] = t
                break
        else:
            out[name] = t
    for (prefix, fused, suffix), parts in groups.items():
        missing = [p for p in FUSED[fused] if p not in parts]
        if missing:
            raise FlotillaError(f"{prefix}.{fused}.{suffix}: {', '.join(missing)} missing; the fused tensor needs "
                                "every projection")
        ordered = [parts[p] for p in FUSED[fused]]
        if suffix == "g_idx":
            if any(not torch.equal(ordered[0], t) for t in ordered[1:]):
                raise FlotillaError(f"{prefix}.{fused}: its projections have different g_idx, which one fused "
                                    "tensor cannot hold")
            joined = ordered[0]
        else:
            joined = torch.cat(ordered, dim=1 if suffix in COLUMNS else 0)
        out[f"{prefix}.{fused}.{suffix}"] = joined
    return out
