"""The tensor-parallel context: which rank of how many this process is, and its collectives.

The model never sees it. The layer factories (`make_linear`, `make_embedding`, `make_lm_head`)
read the group that is current while a model is built,

    with tensor_parallel(TPGroup(rank, world_size, process_group)):
        model = load_stage(source, stage)

and build parallel layers that keep the group and call its collectives. Outside that block they
build the ordinary single-device layers. With pipeline parallelism each stage is built under its
own group (the processes of that stage), so one process may serve one stage of one TP group.

`check_divisible` says, before anything is loaded, whether a model can be split `world_size`
ways, naming the numbers that do not divide and the sizes that would.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from flotilla.errors import FlotillaError


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group. `group` is the torch.distributed process
    group (None: the default group); ranks are ranks within it."""

    rank: int
    world_size: int
    group: object | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def part(self, n: int) -> slice:
        """This rank's share [rank * n / world, (rank + 1) * n / world) of an axis of n (divisible)."""
        if n % self.world_size:
            raise FlotillaError(f"an axis of {n} does not divide among {self.world_size} tensor-parallel ranks")
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (x must be contiguous); returns x."""
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (x must be contiguous); returns x."""
        dist.broadcast(x, group=self.group, group_src=0)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, n] on every rank -> [N, n * world] (rank order) on rank 0, an empty [N, 0] elsewhere.
        Only rank 0 samples, so only it needs the whole vocabulary's logits."""
        x = x.contiguous()
        if not self.is_first:
            dist.gather(x, None, group=self.group, group_dst=0)
            return x.new_empty(x.shape[0], 0)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=1)


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """The group models are being built for, or None (single device)."""
    return _current


@contextlib.contextmanager
def tensor_parallel(group: TPGroup | None) -> Iterator[TPGroup | None]:
    """Build layers for `group` inside the block (None or a group of one: ordinary layers)."""
    global _current
    previous, _current = _current, (group if group is not None and group.world_size > 1 else None)
    try:
        yield _current
    finally:
        _current = previous


def check_divisible(config, world_size: int, where: str = "") -> None:
    """Raise a FlotillaError unless `config` (a ModelConfig) splits `world_size` ways.

    Attention heads and KV heads are divided among ranks (each rank attends with whole heads and
    caches only its KV heads), and so are the MLP's intermediate size and the vocabulary (the
    embedding and lm_head rows). Quantized weights add one constraint: a rank's share of each
    packed axis must be whole int32 words (32 / bits values). Group boundaries need not fall on
    rank boundaries: a row-parallel rank keeps the scales and zeros of every group its rows use
    (see flotilla.models.parallel)."""
    if world_size < 1:
        raise FlotillaError(f"the tensor-parallel size must be at least 1, got {world_size}")
    problems = _problems(config, world_size)
    if problems:
        ok = [n for n in range(1, 65) if not _problems(config, n)]
        prefix = f"{where}: " if where else ""
        raise FlotillaError(f"{prefix}tensor parallel size {world_size} does not divide this model: "
                            f"{'; '.join(problems)}; sizes that do: {', '.join(map(str, ok))}")


def _problems(cfg, n: int) -> list[str]:
    out = []
    axes = (("attention heads (num_attention_heads)", cfg.num_attention_heads),
            ("KV heads (num_key_value_heads)", cfg.num_key_value_heads),
            ("intermediate size", cfg.intermediate_size),
            ("vocabulary rows (vocab_size)", cfg.vocab_size))
    for name, size in axes:
        if size % n:
            out.append(f"{size} {name} % {n} = {size % n}")
    if getattr(cfg.quant, "bits", None) and not out:  # GPTQ packing (GGUF blocks: models.gguf_parallel)
        per_word = 32 // cfg.quant.bits
        shares = (("a rank's query width", cfg.q_size // n), ("a rank's KV width", cfg.kv_size // n),
                  ("a rank's intermediate width", cfg.intermediate_size // n))
        for name, size in shares:
            if size % per_word:
                out.append(f"{name} {size} is not a multiple of {per_word} ({cfg.quant.bits}-bit values "
                           f"per packed int32 word)")
    return out
