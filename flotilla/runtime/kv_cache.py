"""The physical KV cache of one stage, its sizing from a memory budget, and the paged attention
backend that the model calls.

Every stage of a pipeline uses the same block ids, so the head sizes the pool to the smallest
stage; a stage holds blocks only for its own layers.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from flotilla.errors import FlotillaError
from flotilla.kernels.attention import PagedAttentionMetadata, paged_attention, store_kv
from flotilla.kernels.fused import rope_store_kv

from .host_memory import resident_bytes, zero_pages

DEFAULT_FRACTION = 0.3  # of free memory: a GPU's default KV cache, and the most a CPU's default may take
CPU_SHARED_TOKENS = 8192  # a CPU's default holds this many tokens across sequences (or one whole context)

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise FlotillaError(f"--kv-cache-memory {text!r}: expected a size such as 2GiB, 512MiB or 1.5G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now (CUDA: the driver's count; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise FlotillaError("cannot tell how much memory is free here; pass --kv-cache-memory")


@dataclass(frozen=True)
class KVCacheSpec:
    layers: tuple[int, ...]  # the global indices of this stage's layers
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    # a hybrid cache (HybridBlockManager): `layers` dealt into groups of one kind and of equal size, each group's
    # layers in the order of its places (None: an empty place), and each group's sliding window (0: the whole
    # context); a block then holds one group's keys and values. (): a block holds every layer's
    groups: tuple[tuple[int | None, ...], ...] = ()
    group_windows: tuple[int, ...] = ()

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0]) if self.groups else len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers_per_block * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block

    def blocks_per_sequence(self, tokens: int, chunk: int | None = None) -> int:
        """The blocks one sequence of `tokens` tokens holds, every group's: while it decodes (a sliding group its
        window's blocks and 2 at the ends), or with `chunk` at a step's peak (window_blocks: steps of up to
        `chunk` tokens)."""
        k = -(-tokens // self.block_size)
        if not self.groups:
            return k
        return sum(min(k, window_blocks(w, self.block_size, chunk) if chunk is not None
                       else -(-(w - 1) // self.block_size) + 2) if w else k for w in self.group_windows)

    def describe(self, num_blocks: int, context: int | None = None) -> str:
        """The startup line; `context`: the longest context served (a hybrid cache's line says what one sequence
        of it holds)."""
        mib = num_blocks * self.bytes_per_block / 2**20
        usable = num_blocks - 1  # block 0 is the null block (block_pool): padding, never holds a token
        if not self.groups:
            return (f"KV cache: {usable} blocks x {self.block_size} tokens = {usable * self.block_size} tokens "
                    f"(+1 padding block), {mib:.1f} MiB ({self.bytes_per_block / 1024:.1f} KiB a block, "
                    f"{len(self.layers)} layers)")
        whole = sum(1 for w in self.group_windows if not w)
        window = max(self.group_windows)
        line = (f"KV cache: {usable} blocks x {self.block_size} tokens (+1 padding block), {mib:.1f} MiB "
                f"({self.bytes_per_block / 1024:.1f} KiB a block of {self.layers_per_block} layers); hybrid: "
                f"{whole} whole-context and {len(self.groups) - whole} sliding-window groups of layers (window "
                f"{window}): a decoding sequence of n tokens holds n / {self.block_size} blocks in each "
                f"whole-context group and at most {-(-(window - 1) // self.block_size) + 2} in each sliding one")
        if context:
            fit = usable // self.blocks_per_sequence(context)
            line += f"; room for {fit} sequence{'' if fit == 1 else 's'} of {context} tokens"
        return line


def hybrid_groups(layers: tuple[int, ...], window_of) -> tuple[tuple[tuple[int | None, ...], ...], tuple[int, ...]]:
    """KVCacheSpec.groups and group_windows for `layers`, whose sliding windows are window_of(layer) (0: the
    whole context): each kind dealt in order into groups of the smaller kind's count, whole-context groups first;
    ((), ()) where the layers are all of one kind."""
    whole = [layer for layer in layers if not window_of(layer)]
    sliding = [layer for layer in layers if window_of(layer)]
    if not whole or not sliding:
        return (), ()
    size = min(len(whole), len(sliding))
    groups, windows = [], []
    for kind in (whole, sliding):
        for i in range(0, len(kind), size):
            part = kind[i:i + size]
            groups.append(tuple(part) + (None,) * (size - len(part)))
            windows.append(max(window_of(layer) for layer in part))
    return tuple(groups), tuple(windows)


def plan_num_blocks(spec: KVCacheSpec, device: torch.device, memory: str | int | None = None,
                    fraction: float = DEFAULT_FRACTION, max_blocks: int | None = None) -> int:
    """Blocks for a budget of `memory` bytes, or else `fraction` of the device's free memory;
    capped at `max_blocks` (no point holding more than max_num_seqs full contexts)."""
    if memory is not None:
        budget = parse_memory(memory) if isinstance(memory, str) else int(memory)
        where = f"--kv-cache-memory {memory}"
    else:
        budget, where = _fraction_budget(device, fraction)
    n = spec.num_blocks_for(budget)
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n < 2:
        raise FlotillaError(f"{where} gives room for {n} KV blocks of {spec.bytes_per_block} bytes; need at least 2")
    return n


def _fraction_budget(device: torch.device, fraction: float) -> tuple[int, str]:
    if not 0 < fraction <= 1:
        raise FlotillaError(f"the KV cache memory fraction must be in (0, 1], got {fraction}")
    return int(free_memory(device) * fraction), f"{fraction:.0%} of the free memory"


def cpu_default_tokens(max_model_len: int, max_num_seqs: int) -> int:
    """A CPU's default KV cache in tokens: max_num_seqs whole contexts, but no more than
    CPU_SHARED_TOKENS in all unless one context alone needs more (a CPU decodes a few thousand
    tokens a second at best, so a bigger pool would sit idle while holding the memory)."""
    return max(max_model_len, min(max_num_seqs * max_model_len, CPU_SHARED_TOKENS))


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    reason: str  # how the size was chosen, for the report


def plan_kv_cache(spec: KVCacheSpec, device: torch.device, max_model_len: int, max_num_seqs: int,
                  memory: str | None = None, fraction: float | None = None, shares: int = 1) -> KVCachePlan:
    """The KV pool of one engine: `--kv-cache-memory`, else `--kv-cache-fraction` of free memory;
    by default a GPU takes DEFAULT_FRACTION of its free memory and a CPU room for
    cpu_default_tokens (at most DEFAULT_FRACTION of free memory). Never more than max_num_seqs whole
    contexts; `shares`: processes sharing this memory (tensor-parallel ranks on one CPU)."""
    cap = max_num_seqs * -(-max_model_len // spec.block_size) + 1  # (+ the null block)
    if memory is not None or fraction is not None:
        n = plan_num_blocks(spec, device, memory, (DEFAULT_FRACTION if fraction is None else fraction) / shares, cap)
        flag = f"--kv-cache-memory {memory}" if memory is not None else f"--kv-cache-fraction {fraction}"
        return KVCachePlan(n, flag)
    if device.type != "cpu":
        n = plan_num_blocks(spec, device, None, DEFAULT_FRACTION / shares, cap)
        return KVCachePlan(n, f"default: {DEFAULT_FRACTION:.0%} of free GPU memory")
    tokens = cpu_default_tokens(max_model_len, max_num_seqs)
    want = min(-(-tokens // spec.block_size) + 1, cap)
    ceiling, _ = _fraction_budget(device, DEFAULT_FRACTION / shares)
    n = min(want, spec.num_blocks_for(ceiling))
    if n < 2:
        raise FlotillaError(f"{DEFAULT_FRACTION:.0%} of the free memory holds {n} KV blocks of "
                            f"{spec.bytes_per_block} bytes; need at least 2: free memory or pass --kv-cache-memory")
    if n < want:
        return KVCachePlan(n, f"default: {tokens} tokens did not fit, capped at {DEFAULT_FRACTION:.0%} of free memory")
    seqs = f"{max_num_seqs} sequences" if max_num_seqs > 1 else "1 sequence"
    return KVCachePlan(n, f"default on CPU: {tokens} tokens for up to {seqs} of up to {max_model_len}; "
                          "--kv-cache-memory to change")


class KVCache:
    """Per-layer key and value caches [num_blocks, block_size, Hkv, D], zero-filled (padding
    reads the null block and stale slots; they must hold finite numbers).

    On a CPU the storage is untouched anonymous pages (host_memory.zero_pages): a block takes RAM
    only once a step writes it, so the process holds the blocks in use, not the whole pool."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.spec, self.num_blocks, self.device = spec, num_blocks, torch.device(device)
        # [places, (k, v), blocks, block_size, Hkv, D]: a place per layer, or per place of a group (a hybrid
        # cache's groups share the places' tensors, each group in its own blocks)
        shape = (spec.layers_per_block, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            self.storage = zero_pages(shape, spec.dtype)
        else:
            self.storage = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.group_of: dict[int, int] = {}  # a hybrid cache's layer -> its group (PagedAttentionBackend)
        places = {layer: i for i, layer in enumerate(spec.layers)}
        for g, group in enumerate(spec.groups):
            for i, layer in enumerate(group):
                if layer is not None:
                    places[layer], self.group_of[layer] = i, g
        self.key = {layer: self.storage[i, 0] for layer, i in places.items()}
        self.value = {layer: self.storage[i, 1] for layer, i in places.items()}

    @property
    def reserved_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def resident_bytes(self) -> int | None:
        """Of reserved_bytes, what is in RAM now (CPU; None where it cannot tell)."""
        return resident_bytes(self.storage) if self.device.type == "cpu" else None


class PagedAttentionBackend:
    """The model's attention backend for one step: store this step's keys and values, then attend
    through the block tables."""

    def __init__(self, cache: KVCache, meta: PagedAttentionMetadata, scale: float,
                 group_metas: list[PagedAttentionMetadata] | None = None):
        """`group_metas`: a hybrid cache's step over the tables of its groups 1, 2, ... (StepInput.group_tables);
        `meta` is group 0's."""
        if len(cache.spec.groups) != (1 + len(group_metas) if group_metas is not None else 0):
            raise ValueError(f"a cache of {len(cache.spec.groups)} groups of layers with the tables of "
                             f"{1 + len(group_metas) if group_metas is not None else 0}")
        self.cache, self.meta, self.scale = cache, meta, scale
        self.metas = [meta, *(group_metas or ())]

    def _meta(self, layer: int) -> PagedAttentionMetadata:
        return self.metas[self.cache.group_of.get(layer, 0)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        kc, vc, meta = self.cache.key[layer], self.cache.value[layer], self._meta(layer)
        store_kv(kc, vc, k, v, meta)
        return paged_attention(q, kc, vc, meta, self.scale, window, softcap)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """`attend` of the unrotated projection qkv [T, (Hq + 2 Hkv) D]: rope, the store of k and v and
        the attention, the first two in one kernel on CUDA (kernels/fused.py rope_store_kv)."""
        kc, vc, meta = self.cache.key[layer], self.cache.value[layer], self._meta(layer)
        q = rope_store_kv(qkv, cos, sin, num_heads, kc, vc, meta.slot_mapping)
        return paged_attention(q, kc, vc, meta, self.scale, window, softcap)


def window_blocks(window: int, block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks a sliding-window group holds for one sequence during a step. A step's new blocks are taken
    before the blocks behind its window go back (BlockManager.allocate_slots), so at that moment the group holds
    those from the window of the step before (whose chunk was up to max_num_batched_tokens) to this step's last
    token (another chunk): window + 2 chunks, and 3 blocks for the ends falling inside a block."""
    return -(-(window - 1 + 2 * max_num_batched_tokens) // block_size) + 3


def hybrid_plan(spec: KVCacheSpec, plain: KVCachePlan, max_model_len: int, max_num_seqs: int,
                max_num_batched_tokens: int) -> tuple[int, int]:
    """(blocks, longest context) of a hybrid cache (`spec.groups`) in the memory of `plain`, the plan of a cache
    whose blocks hold every layer: as many blocks of one group's size as that memory holds, up to what max_num_seqs
    sequences of max_model_len tokens take; the longest context is what one sequence alone can reach."""
    whole = dataclasses.replace(spec, groups=(), group_windows=())
    budget = plain.num_blocks * whole.bytes_per_block
    longest = spec.blocks_per_sequence(max_model_len, max_num_batched_tokens)
    n = max(2, min(max_num_seqs * longest + 1, budget // spec.bytes_per_block))
    if n - 1 >= longest:
        return n, max_model_len
    lo, hi = 0, -(-max_model_len // spec.block_size)  # blocks of the longest sequence that fits alone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if spec.blocks_per_sequence(mid * spec.block_size, max_num_batched_tokens) <= n - 1:
            lo = mid
        else:
            hi = mid - 1
    return n, lo * spec.block_size
