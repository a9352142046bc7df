"""Open a model path (flotilla checkpoint, Hugging Face directory or GGUF file) for the runtime."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flotilla.errors import FlotillaError
from flotilla.models import parallel_state
from flotilla.models.config import GEMMA_FAMILIES, ModelConfig
from flotilla.models.gguf_report import load_report
from flotilla.models.fused_names import unwrapped
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


def default_dtype(device: torch.device, config: ModelConfig | None = None) -> torch.dtype:
    """fp32 on a CPU; on a GPU fp16, but bf16 for Gemma 3, whose activations pass fp16's range (vLLM refuses
    fp16 for it)."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if config is not None and config.family in GEMMA_FAMILIES else torch.float16


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return default_dtype(device)
    if name not in DTYPES:
        raise FlotillaError(f"unknown dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str | None) -> torch.device:
    """cpu, cuda or cuda:N (auto / None: cuda where a GPU is visible); a CUDA device always with its index."""
    if name in (None, "auto"):
        return with_index(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FlotillaError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # torch knows mps, meta, xpu, ...; flotilla's kernels do not
        raise FlotillaError(f"device {name!r}: flotilla runs on cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlotillaError(f"device {name!r} asked for, but no CUDA GPU is available")
    return with_index(device)


def with_index(device: torch.device) -> torch.device:
    """A bare `cuda` as the GPU it means, the current one (`cuda:N`): torch.cuda.set_device, which the loader and
    the engine's threads call, refuses a CUDA device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def load_model(model: str | Path | None, device: str | torch.device | None = None, dtype: str | None = None,
               stage: Stage | None = None, with_tokenizer: bool = True, progress: bool | None = None,
               keep_source: bool = False) -> LoadedModel:
    """Load a model for the runtime; a progress bar is shown when stderr is a terminal. An entry
    point loading on the CPU wraps this in `host_memory.lean_cpu_load` (glibc settings are the
    process's, not a library's, to change). `keep_source`: the quantized linears keep their GPTQ
    tensors beside their kernels' own form (for code that reads them back; twice the memory)."""
    path = resolve_model_path(str(model) if model else None)
    dev = with_index(device) if isinstance(device, torch.device) else parse_device(device)
    dt = parse_dtype(dtype, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # this thread's kernel builds, launches and graph captures go to that GPU
    source = open_source(path)
    if dtype in (None, "auto"):
        dt = default_dtype(dev, source.config)
    if progress is None:
        progress = sys.stderr.isatty()
    m = load_stage(source, stage, dev, dt, progress=progress, keep_source=keep_source)
    if isinstance(unwrapped(source), GGUFSource) and source.native and _reports():
        for line in load_report(source, m):
            print(line, file=sys.stderr)
    tok = load_tokenizer(path, source.config.eos_token_ids) if with_tokenizer else None
    return LoadedModel(path, source.config, m, tok, dev, dt)


def _reports() -> bool:
    """Whether this process says what it loaded (not the other ranks of a tensor-parallel group)."""
    group = parallel_state.current()
    return group is None or group.rank == 0

