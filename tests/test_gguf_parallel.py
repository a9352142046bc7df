"""GGUF models split over tensor-parallel CPU ranks (gloo) and pipeline stages, in their blocks."""
from __future__ import annotations

import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.llama import Stage
from flotilla.models.parallel_state import TPGroup, tensor_parallel
from flotilla.models.sources import GGUFSource
from flotilla.models.weights import load_stage

from ggml_helpers import mixed_gguf
from test_tp import ATOL, run_ranks


def test_tp2_logits_equal_tp1_native_and_where_a_share_is_not_whole_blocks(tmp_path):
    whole = mixed_gguf(tmp_path / "a", tied=True)  # hidden 64: every rank's share is whole groups of 32
    odd = mixed_gguf(tmp_path / "b", hidden_size=96, intermediate_size=192)  # o_proj: 48 inputs a rank
    got = run_ranks(2, [whole, odd], tmp_path)
    for i, path in enumerate((whole, odd)):
        for way in ("live", "frozen"):
            ref = got[f"{i}.tp1.frozen" if way == "frozen" else f"{i}.tp1"]
            assert (got[f"{i}.{way}"] - ref).abs().max().item() < ATOL, (path, way)
    assert (got["0.stages"] - got["0.tp1"]).abs().max().item() < ATOL


def test_a_share_of_whole_blocks_stays_native_else_fp32(tmp_path, monkeypatch):
    """The forms a rank's layers run in, built without a process group (nothing collective runs)."""
    group = TPGroup(1, 2)
    for path, o_form in ((mixed_gguf(tmp_path / "a"), "4-bit"),
                         (mixed_gguf(tmp_path / "b", hidden_size=96, intermediate_size=192), "fp32: a rank's share")):
        with tensor_parallel(group):
            model = load_stage(GGUFSource(path))
        attn = model.model.layers["0"].self_attn
        assert attn.o_proj.part_form(0).startswith(("cpu " + o_form, o_form)), attn.o_proj.part_form(0)
        assert "5-bit" in attn.qkv_proj.part_form(2)  # column-parallel: always native


def test_pipeline_stages_of_a_tied_gguf_compose_to_the_whole(tmp_path):
    path = mixed_gguf(tmp_path, tied=True)
    whole = load_stage(GGUFSource(path))
    first, last = load_stage(GGUFSource(path), Stage(0, 2, 3)), load_stage(GGUFSource(path), Stage(2, 3, 3))
    ids = torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(15)
    with torch.no_grad():
        split = last.compute_logits(last(first(ids, pos, DenseCausalAttention(1, 15)), pos, DenseCausalAttention(1, 15)))
        ref = whole.compute_logits(whole(ids, pos, DenseCausalAttention(1, 15)))
    assert torch.equal(split, ref)
