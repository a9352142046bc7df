"""How big the KV cache is by default: on a CPU from the context length and --max-num-seqs (not a
fraction of RAM), on a GPU a fraction of its free memory; the flags override both."""
from __future__ import annotations

import pytest
import torch

from flotilla.errors import FlotillaError
from flotilla.runtime import kv_cache
from flotilla.runtime.kv_cache import KVCacheSpec, plan_kv_cache

# SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 x (k, v) x 4 bytes x 16 tokens = 720 KiB a block
SPEC = KVCacheSpec(tuple(range(30)), 3, 64, torch.float32, 16)
CPU = torch.device("cpu")
GiB = 2**30


@pytest.fixture
def free(monkeypatch):
    """Pretend the device has this much free memory."""
    def set_free(nbytes: int):
        monkeypatch.setattr(kv_cache, "free_memory", lambda device: nbytes)
    set_free(20 * GiB)
    return set_free


@pytest.mark.parametrize("max_len,seqs,blocks", [
    (8192, 64, 8192 // 16 + 1),  # serve on the default model: one whole context, 360 MiB
    (8192, 1, 8192 // 16 + 1),  # generate / chat: one context
    (2048, 1, 2048 // 16 + 1),  # generate --max-model-len 2048: 90 MiB
    (2048, 64, 8192 // 16 + 1),  # shared by the sequences: 4 contexts' worth
    (2048, 2, 2 * 2048 // 16 + 1),  # never more than max_num_seqs whole contexts
    (100, 1, 7 + 1),  # a partial last block is a whole block
])
def test_cpu_default_comes_from_the_context_and_the_sequences(free, max_len, seqs, blocks):
    plan = plan_kv_cache(SPEC, CPU, max_len, seqs)
    assert plan.num_blocks == blocks
    assert plan.reason.startswith("default on CPU") and "--kv-cache-memory" in plan.reason
    free(200 * GiB)  # not a fraction of RAM: more free memory changes nothing
    assert plan_kv_cache(SPEC, CPU, max_len, seqs).num_blocks == blocks


def test_cpu_default_is_capped_by_free_memory_and_says_so(free):
    free(100 * SPEC.bytes_per_block)
    plan = plan_kv_cache(SPEC, CPU, 8192, 64)
    assert plan.num_blocks == 30 and "capped at 30% of free memory" in plan.reason
    free(SPEC.bytes_per_block)
    with pytest.raises(FlotillaError, match="need at least 2.*--kv-cache-memory"):
        plan_kv_cache(SPEC, CPU, 8192, 64)


def test_flags_override_the_default(free):
    plan = plan_kv_cache(SPEC, CPU, 8192, 64, memory="72MiB")
    assert (plan.num_blocks, plan.reason) == (72 * 2**20 // SPEC.bytes_per_block, "--kv-cache-memory 72MiB")
    free(GiB)
    plan = plan_kv_cache(SPEC, CPU, 8192, 64, fraction=0.5)
    assert (plan.num_blocks, plan.reason) == (GiB // 2 // SPEC.bytes_per_block, "--kv-cache-fraction 0.5")
    assert plan_kv_cache(SPEC, CPU, 8192, 64, fraction=0.5, shares=2).num_blocks == GiB // 4 // SPEC.bytes_per_block
    assert plan_kv_cache(SPEC, CPU, 64, 2, memory="1GiB").num_blocks == 2 * 4 + 1  # max_num_seqs contexts at most


def test_gpu_default_stays_a_fraction_of_free_memory(free):
    free(10 * GiB)
    plan = plan_kv_cache(SPEC, torch.device("cuda"), 8192, 64)
    assert plan.num_blocks == int(10 * GiB * 0.3) // SPEC.bytes_per_block
    assert plan.reason == "default: 30% of free GPU memory"


def test_a_fraction_out_of_range_is_an_error(free):
    for bad in (0.0, 1.5):
        with pytest.raises(FlotillaError, match=r"must be in \(0, 1\]"):
            plan_kv_cache(SPEC, CPU, 8192, 64, fraction=bad)
