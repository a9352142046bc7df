"""Which decoder layers each stage runs.

Stages keep the order of `--hosts`. Each worker reports its free memory and how long one of this
model's decoder layers (and the lm_head) takes on it for one decode token; the split minimises
the slowest stage's time per token,

    time_i = layers_i x layer_ms_i  (+ head_ms_i on the last stage),

subject to every stage's weights fitting in a fraction of its free memory (the rest is left for
the KV cache and activations). Stages whose workers share memory (several on one GPU, or CPU
workers of one machine) each count an equal share of it. A mixed ring needs nothing more: a CPU
worker's probe is slow, so it gets few layers. `--layers 10,10,12` replaces all of this.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from flotilla.errors import FlotillaError
from flotilla.models.llama import Stage

WEIGHT_MEMORY_FRACTION = 0.8  # of a worker's free memory, for its weights


@dataclass(frozen=True)
class StageBudget:
    """What one worker reported (see messages.WorkerInfo)."""

    name: str  # host:port, for messages
    free_memory: int
    layer_bytes: int
    head_bytes: int  # the embedding (first stage) and the lm_head (last stage) each take this much
    layer_ms: float
    head_ms: float

    def fixed_bytes(self, first: bool, last: bool) -> int:
        return self.head_bytes * (int(first) + int(last))

    def fixed_ms(self, last: bool) -> float:
        return self.head_ms if last else 0.0

    def per_layer_ms(self) -> float:
        return self.layer_ms if self.layer_ms > 0 else 1.0


def sharing(memory_ids: list[str]) -> list[int]:
    """For each stage, how many stages (itself included) report the same memory."""
    counts = Counter(memory_ids)
    return [counts[m] for m in memory_ids]


def shared_without_mps(devices: list[str], memory_ids: list[str], mps: list[bool]) -> list[list[int]]:
    """Groups of stages on one GPU of which some worker is no MPS client: the GPU switches between
    their processes' contexts at every hop between them (mps.py)."""
    groups: dict[str, list[int]] = {}
    for i, (d, m) in enumerate(zip(devices, memory_ids)):
        if d.startswith("cuda"):
            groups.setdefault(m, []).append(i)
    return [g for g in groups.values() if len(g) > 1 and not all(mps[i] for i in g)]


def compute_units(devices: list[str], memory_ids: list[str]) -> int:
    """How many stages can compute at the same time: the micro-batches worth keeping in flight.
    Stages on one GPU take turns (its processes' CUDA contexts are time-sliced), so they count
    once; every CPU stage counts (the CPU workers of a machine split its cores)."""
    gpus = {m for d, m in zip(devices, memory_ids) if d.startswith("cuda")}
    return len(gpus) + sum(not d.startswith("cuda") for d in devices)


def stages_from_counts(counts: list[int]) -> list[Stage]:
    total, start, stages = sum(counts), 0, []
    for n in counts:
        stages.append(Stage(start, start + n, total))
        start += n
    return stages


def parse_layers(text: str, num_layers: int, pp: int) -> list[int]:
    """`--layers 10,10,12` -> [10, 10, 12], checked against the model and --pp."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise FlotillaError(f"--layers {text!r}: expected comma-separated layer counts such as 10,10,12") from None
    if len(counts) != pp:
        raise FlotillaError(f"--layers {text!r} gives {len(counts)} stages, but --pp is {pp}")
    if any(n < 1 for n in counts):
        raise FlotillaError(f"--layers {text!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise FlotillaError(f"--layers {text!r} adds up to {sum(counts)} layers; the model has {num_layers}")
    return counts


def split_layers(num_layers: int, budgets: list[StageBudget],
                 memory_fraction: float = WEIGHT_MEMORY_FRACTION) -> list[int]:
    """Layer counts per stage minimising the slowest stage, within every stage's memory."""
    S = len(budgets)
    if S > num_layers:
        raise FlotillaError(f"--pp {S} is more stages than the model's {num_layers} layers")
    mem_caps = []
    for i, b in enumerate(budgets):
        room = int(b.free_memory * memory_fraction) - b.fixed_bytes(i == 0, i == S - 1)
        mem_caps.append(max(0, room // max(1, b.layer_bytes)))
    if any(c < 1 for c in mem_caps) or sum(mem_caps) < num_layers:
        need = ", ".join(f"{b.name}: {b.layer_bytes / 2**20:.1f} MiB a layer, {b.free_memory / 2**30:.2f} GiB free"
                         for b in budgets)
        raise FlotillaError(f"the model's {num_layers} layers do not fit these workers' memory "
                            f"(room for {mem_caps} layers at {memory_fraction:.0%} of free memory; {need}); "
                            "add workers or free memory")

    def caps(t: float) -> list[int]:
        out = []
        for i, b in enumerate(budgets):
            by_time = int((t - b.fixed_ms(i == S - 1)) // b.per_layer_ms())
            out.append(min(mem_caps[i], max(0, by_time)))
        return out

    def feasible(t: float) -> bool:
        c = caps(t)
        return all(n >= 1 for n in c) and sum(c) >= num_layers

    lo, hi = 0.0, max(num_layers * b.per_layer_ms() + b.fixed_ms(True) for b in budgets)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    counts = caps(hi)
    while sum(counts) > num_layers:  # trim the slowest stage that can give a layer up
        times = [(n * b.per_layer_ms() + b.fixed_ms(i == S - 1), i) for i, (n, b) in enumerate(zip(counts, budgets))
                 if n > 1]
        counts[max(times)[1]] -= 1
    return counts


def describe(stages: list[Stage], names: list[str], source: str) -> str:
    """One line per stage, e.g. 'stage 1  10.0.0.3:7070  layers 10-19 (10)'."""
    lines = [f"pipeline split ({source}):"]
    for i, (st, name) in enumerate(zip(stages, names)):
        extra = " + embeddings" if st.is_first else ""
        extra += " + lm_head" if st.is_last else ""
        lines.append(f"  stage {i}  {name}  layers {st.start}-{st.end - 1} ({st.end - st.start}){extra}")
    return "\n".join(lines)
