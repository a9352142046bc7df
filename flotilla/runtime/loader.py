"""Open a model path (flotilla checkpoint, Hugging Face directory or GGUF file) for the runtime."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flotilla.errors import FlotillaError
from flotilla.models import parallel_state
from flotilla.models.config import ModelConfig
from flotilla.models.gguf_report import load_report
from flotilla.models.gguf_source import GGUFSource
from flotilla.models.llama import CausalLM, Stage
from flotilla.models.sources import open_source
from flotilla.models.tokenizer import Tokenizer, load_tokenizer
from flotilla.models.weights import load_stage

from .default_model import resolve_model_path

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    parallel: Any = None  # a runtime.tp.TensorParallel when this process is rank 0 of a TP group


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.float16


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return default_dtype(device)
    if name not in DTYPES:
        raise FlotillaError(f"unknown dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FlotillaError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlotillaError(f"device {name!r} asked for, but no CUDA GPU is available")
    return device


def load_model(model: str | Path | None, device: str | torch.device | None = None, dtype: str | None = None,
               stage: Stage | None = None, with_tokenizer: bool = True, progress: bool | None = None) -> LoadedModel:
    """Load a model for the runtime; a progress bar is shown when stderr is a terminal."""
    path = resolve_model_path(str(model) if model else None)
    dev = device if isinstance(device, torch.device) else parse_device(device)
    dt = parse_dtype(dtype, dev)
    source = open_source(path)
    if progress is None:
        progress = sys.stderr.isatty()
    libc = _libc() if dev.type == "cpu" else None
    if libc is not None:  # give large freed blocks back to the system at once (see _libc)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks from 1 MiB up are mapped, unmapped when freed
    m = load_stage(source, stage, dev, dt, progress=progress)
    if libc is not None:
        libc.malloc_trim(0)  # and the small ones the load freed
        # then what glibc's dynamic thresholds settle at: a step's activations (up to tens of MB
        # in a prefill) reuse the heap instead of faulting in fresh pages on every call
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    if isinstance(source, GGUFSource) and source.native and _reports():
        for line in load_report(source, m):
            print(line, file=sys.stderr)
    tok = load_tokenizer(path, source.config.eos_token_ids) if with_tokenizer else None
    return LoadedModel(path, source.config, m, tok, dev, dt)


def _reports() -> bool:
    """Whether this process says what it loaded (not the other ranks of a tensor-parallel group)."""
    group = parallel_state.current()
    return group is None or group.rank == 0


def _libc():
    """glibc, to keep a CPU load's transient memory out of the process's footprint, or None.

    Loading packs one tensor at a time through buffers of up to tens of MB. With glibc's defaults,
    whose threshold for returning a freed block to the system grows with the blocks freed, those
    would stay in the process for good (measured: ~60 MB of a 135M-parameter model's load, and
    another ~20 MB of small freed blocks that malloc_trim returns)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
