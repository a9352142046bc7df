"""What a `quantize` run did: sizes, time, memory; printed as the CLI's final summary."""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: VmHWM of /proc/self/status where there is one
    (getrusage's ru_maxrss also counts the parent's memory at fork, carried across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def peak_gpu_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def source_bytes(path: Path) -> int:
    """Bytes of the source's weights on disk (the .gguf file, or a directory's safetensors)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


LINEAR_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", "_proj.weight")


def linear_storage(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a layer's linear weights as stored (codes, scales, zeros, g_idx; fp16 weights of
    linears left unquantized), biases and norms excluded."""
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name.endswith(LINEAR_SUFFIXES))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@dataclass(frozen=True)
class QuantizeReport:
    out: Path
    label: str
    parameters: int
    source_bytes: int  # on disk
    out_bytes: int  # the written shards
    shards: int
    seconds: float
    peak_rss: int
    peak_gpu: int | None
    calib_tokens: int  # 0 for RTN
    calib_from: str  # the file, "model-generated" or "none"
    damp_raised: int  # linears whose GPTQ damping had to be raised
    bits_per_weight: float = 0.0  # stored bits per weight of the decoder's linears (scales etc. included)
    kept: tuple[str, ...] = ()  # "layer.linear:bits" of the linears above the base bit width
    untied_head: bool = False  # --rotate untied a tied lm_head: its own copy is in bits_per_weight
    norm_matrix: bool = False  # --rotate-tied-head: the final norm's hidden x hidden matrix is in bits_per_weight
    head_bits: int | None = None  # --lm-head-bits: the lm_head written apart, quantized

    @property
    def fp16_bytes(self) -> int:
        return self.parameters * 2

    def lines(self) -> list[str]:
        lines = [
            f"wrote {self.out} ({self.label}, {self.shards} shard{'s' if self.shards != 1 else ''})",
            f"  size      source {_mb(self.source_bytes)} on disk, fp16 {_mb(self.fp16_bytes)} "
            f"-> {_mb(self.out_bytes)} ({self.fp16_bytes / self.out_bytes:.2f}x smaller than fp16, "
            f"{self.source_bytes / self.out_bytes:.2f}x vs source)",
            f"  time      {self.seconds:.1f} s",
            f"  memory    peak RSS {_mb(self.peak_rss)}" + (f", peak GPU {_mb(self.peak_gpu)}" if self.peak_gpu else ""),
            f"  calib     {self.calib_tokens:,} tokens ({self.calib_from})",
            f"  bits      {self.bits_per_weight:.3f} per linear weight on average (scales, zeros, g_idx included)",
        ]
        if self.untied_head:
            lines.append("  rotation  untied the tied lm_head: its own copy is counted in the bits per weight above")
        if self.norm_matrix and self.head_bits:
            lines.append(f"  rotation  the final norm's hidden x hidden matrix (counted in the bits per weight above) "
                         f"and the lm_head written apart at {self.head_bits} bits (a flotilla-only checkpoint)")
        elif self.norm_matrix:
            lines.append("  rotation  kept the lm_head tied: the final norm's hidden x hidden matrix is counted in the "
                         "bits per weight above (a flotilla-only checkpoint)")
        if self.head_bits:
            lines.append(f"  lm_head   quantized to {self.head_bits} bits (--lm-head-bits)")
        if self.kept:
            lines.append(f"  mixed     {len(self.kept)} linear(s) kept wider: {', '.join(self.kept)}")
        if self.damp_raised:
            lines.append(f"  note      GPTQ damping was raised for {self.damp_raised} linear(s)")
        return lines
