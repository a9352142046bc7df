"""A worker's answer to `Probe`: its free memory and a short speed probe on the model's shapes.

The probe builds one decoder layer of the model (same sizes, same quantization, so the same
kernels) with made-up weights, and times it for one decode token; then a slice of the lm_head
matmul, scaled to the vocabulary. Well under a second on a CPU for a small model; the head
splits the layers with these figures (partition.py).

On a GPU both are timed as a stage runs its decodes: GRAPH_CALLS calls captured in one CUDA
graph and replayed, so kernel launches do not count (timed call by call, a layer's dozen small
launches made an 8B layer look 10x slower than it runs, and a CPU stage of a mixed ring got a
third of the layers).
"""
from __future__ import annotations

import json
import socket
import statistics
import time

import torch
import torch.nn.functional as F

from flotilla.models.config import ModelConfig
from flotilla.models.linear import Linear, LMHead, QuantLinear
from flotilla.models.llama import RMSNorm, layer_step
from flotilla.models.rope import RotaryEmbedding
from flotilla.models.weights import build_layer

from flotilla.runtime.kv_cache import free_memory
from flotilla.runtime.loader import parse_dtype

from .messages import Probe, WorkerInfo
from .mps import is_mps_client

PROBE_SECONDS = 0.1
GRAPH_CALLS = 8  # calls per replayed CUDA graph


class _NoAttention:
    """Attention stand-in for the probe: the linears dominate a decode step's time."""

    def attend(self, layer, q, k, v, window=0, softcap=0.0):
        return q


def worker_info(probe: Probe, device: torch.device, version: str, tp: int = 1) -> WorkerInfo:
    """With `tp` ranks (cuda:K … cuda:K+tp-1, or CPU processes sharing the cores) the stage has
    their memory together, and each rank computes 1/tp of every layer: the probe's whole-layer
    times on one device are divided by tp (on a CPU the ranks split the cores, and this process
    already has only its share of the threads, so the division holds there too)."""
    config = ModelConfig.from_hf_dict(json.loads(probe.config_json), where="the head's config.json")
    dtype = parse_dtype(probe.dtype, device)
    elem = torch.empty((), dtype=dtype).element_size()
    head_bytes = config.vocab_size * config.hidden_size * elem
    layer_ms = head_ms = 0.0
    if probe.measure:
        layer = _random_layer(config, device, dtype)
        layer_bytes = _bytes(layer)
        layer_ms, head_ms = _time_layer(layer, config, device, dtype) / tp, _time_head(config, device, dtype) / tp
        del layer
    else:
        layer_bytes = _bytes(build_layer(config, 0, "meta", dtype))
    devices = [device] if device.type == "cpu" else [torch.device("cuda", (device.index or 0) + r) for r in range(tp)]
    return WorkerInfo(version, str(device), sum(free_memory(d) for d in devices), layer_bytes, layer_ms, head_ms,
                      head_bytes, memory_id(device), tp, is_mps_client(device))


def memory_id(device: torch.device) -> str:
    """Names the memory `free_memory(device)` counts: the host's RAM (machine id and host name:
    containers may share the one but not the other), or one GPU (by its UUID, which no other GPU
    has, whichever index a process sees it under). Stages whose workers report the same id
    share that memory."""
    host = f"{_machine_id()}/{socket.gethostname()}"
    if device.type != "cuda":
        return f"{host}/cpu"
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"gpu-{uuid}" if uuid is not None else f"{host}/{device}"


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        except OSError:
            pass
    return ""


def _bytes(module: torch.nn.Module) -> int:
    """The layer's weight bytes: its tensors, with each quantized linear at its GPTQ size (its kernel holds
    its own form of them, the module no longer does)."""
    quant = [m for m in module.modules() if isinstance(m, QuantLinear)]
    held = {id(t) for m in quant for t in [*m.parameters(), *m.buffers()]}
    rest = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if id(t) not in held)
    return rest + sum(m.weight_bytes() for m in quant)


@torch.inference_mode()
def _random_layer(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    layer = build_layer(config, 0, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for mod in layer.modules():
        if isinstance(mod, QuantLinear):
            mod.qweight.copy_(torch.randint(-2**31, 2**31 - 1, mod.qweight.shape, generator=gen, dtype=torch.int32))
            mod.qzeros.fill_(0x77777777 if mod.bits == 4 else 0x7F7F7F7F)
            mod.scales.fill_(0.01)
            mod.g_idx.copy_(torch.arange(mod.in_features, dtype=torch.int32) // max(1, mod.group_size)
                            if mod.group_size > 0 else torch.zeros(mod.in_features, dtype=torch.int32))
            if mod.bias is not None:
                mod.bias.zero_()
            mod.prepare(dtype)
        elif isinstance(mod, Linear):
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * 0.02)
            if mod.bias is not None:
                mod.bias.zero_()
    for mod in layer.modules():  # the input and post-attention norms, and a Qwen3's q and k norms
        if isinstance(mod, RMSNorm):
            mod.weight.fill_(1.0)
    return layer


def _median_ms(fn, device: torch.device) -> float:
    """Median milliseconds of one fn(); on a GPU through a CUDA graph where fn captures."""
    replay = _graphed(fn, device) if device.type == "cuda" else None
    if replay is not None:
        return _median_call_ms(replay, device) / GRAPH_CALLS
    return _median_call_ms(fn, device)


def _graphed(fn, device: torch.device):
    """GRAPH_CALLS calls of fn in one captured CUDA graph (its replay), or None if fn does not capture."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up off the capture: compile kernels, pick tile configs
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        return graph.replay
    except Exception:  # noqa: BLE001 - time it call by call instead
        torch.cuda.synchronize(device)
        return None


def _median_call_ms(fn, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < PROBE_SECONDS and len(times) < 200):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def _time_layer(layer, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> float:
    rope = RotaryEmbedding(config.head_dim, 8, config.rope_theta, config.rope_scaling)
    cos, sin = (t.to(device) for t in rope.tables(torch.zeros(1, dtype=torch.long), dtype))
    x = torch.randn(1, config.hidden_size, device=device, dtype=dtype)
    ops = layer.ops(frozen=True)
    return _median_ms(lambda: layer_step(ops, x, cos, sin, _NoAttention()), device)


@torch.inference_mode()
def _time_head(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> float:
    """The lm_head's time for one token through LMHead.logits_fn (on a CPU the compiled kernels, in
    the weight's smallest exact form), on a slice of the vocabulary scaled up. The weights are fp16
    values, as a checkpoint of ours stores an unquantized head (a quantized or GGUF head reads fewer
    bytes still); timed in fp32 through F.linear, a CPU head read twice the bytes it will, and the
    split gave the last stage too few layers."""
    rows = min(config.vocab_size, 8192)
    with torch.device(device):  # built where it runs: no fp32 copy of it elsewhere first
        head = LMHead(config.hidden_size, rows).to(dtype)
    head.weight.copy_((torch.randn(rows, config.hidden_size, device=device) * 0.02).half())
    fn = head.logits_fn(device) or (lambda x: F.linear(x, head.weight))
    x = torch.randn(1, config.hidden_size, device=device, dtype=dtype)
    return _median_ms(lambda: fn(x), device) * config.vocab_size / rows
