"""The checkpoint writer's commit against interrupts: between its two renames (a --force commit puts the
old OUT back), while it removes the replaced OUT (the interrupt is too late and is dropped), and what a
writer that died leaves (the next one puts a moved-aside OUT back, or removes it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flotilla.models import checkpoint
from flotilla.models.checkpoint import CheckpointWriter
from flotilla.runtime.random_model import shape_config


def write(out, value: float, force: bool = False):
    with CheckpointWriter(out, shape_config("tiny", 16), force=force) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": torch.full((4, 4), value)})
        return w.commit()


def stored(out) -> float:
    from safetensors.torch import load_file

    (shard,) = [p for p in out.iterdir() if p.suffix == ".safetensors"]
    return float(load_file(str(shard))["model.embed_tokens.weight"][0, 0])


def leftovers(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_an_interrupt_between_the_renames_puts_the_old_out_back(tmp_path, monkeypatch):
    out = write(tmp_path / "ckpt", 1.0)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # OUT moved aside; the new checkpoint not yet renamed to OUT
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write(out, 2.0, force=True)
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert stored(out) == 1.0 and leftovers(out) == []


def test_an_interrupt_while_the_replaced_out_is_removed_is_dropped(tmp_path, monkeypatch):
    out = write(tmp_path / "ckpt", 1.0)
    real, hits = checkpoint.shutil.rmtree, []

    def rmtree(path, *a, **k):
        if ".old-" in str(path) and not hits:
            hits.append(path)
            raise KeyboardInterrupt  # Ctrl-C during the removal
        real(path, *a, **k)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    assert write(out, 2.0, force=True) == out  # the write happened: commit returns, no interrupt escapes
    assert hits and stored(out) == 2.0 and leftovers(out) == []


def test_a_dead_writers_moved_aside_out_is_put_back_or_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that no longer runs
    out = write(tmp_path / "ckpt", 1.0)
    aside = tmp_path / f".ckpt.old-{dead}"
    os.replace(out, aside)  # as if the writer died between its renames
    assert not out.exists()
    with pytest.raises(Exception, match="already exists"):  # the next writer of OUT puts it back first
        write(out, 2.0)
    assert stored(out) == 1.0 and leftovers(out) == []
    aside.mkdir()  # a leftover beside an OUT that exists: removed
    write(out, 4.0, force=True)
    assert stored(out) == 4.0 and leftovers(out) == []


def test_an_out_that_appears_during_the_run_is_never_replaced(tmp_path):
    """OUT made by someone else while a run writes (a user, a second run to the same -o) stays as it
    is; the finished checkpoint goes beside it, named in the error, so neither is lost."""
    from flotilla.errors import FlotillaError

    out = tmp_path / "out"
    with CheckpointWriter(out, shape_config("tiny", 16)) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": torch.full((4, 4), 1.0)})
        out.mkdir()
        (out / "notes.txt").write_text("precious")
        with pytest.raises(FlotillaError, match="appeared during the run and was left as it is .*written to .*out.new"):
            w.commit()
    assert (out / "notes.txt").read_text() == "precious" and stored(tmp_path / "out.new") == 1.0
    # --force checks the directory again at the end: one that stopped being a checkpoint is kept too
    write(out2 := tmp_path / "out2", 2.0)
    with CheckpointWriter(out2, shape_config("tiny", 16), force=True) as w:
        w.add_layer("embed", {"model.embed_tokens.weight": torch.full((4, 4), 3.0)})
        (out2 / "notes.txt").write_text("precious")
        (out2 / "photos").mkdir()
        with pytest.raises(FlotillaError, match="holds directories .*written to .*out2.new"):
            w.commit()
    assert (out2 / "notes.txt").exists() and stored(tmp_path / "out2.new") == 3.0
    assert leftovers(out) == [] and leftovers(out2) == []


def test_a_dead_writers_leftover_of_another_name_is_named_not_removed(tmp_path, capsys):
    """A quantize killed while writing OTHER leaves .OTHER.tmp-PID; writing OUT beside it names it (with its size)
    on stderr and leaves it to the next writer of OTHER (an audit found gigabytes left unsaid)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    left = tmp_path / f".other.tmp-{dead}"
    left.mkdir()
    (left / "part-00000-00000.safetensors").write_bytes(b"\0" * (3 << 20))
    (tmp_path / ".another-tool.tmp-12").mkdir()  # no shard parts: not ours to name
    (tmp_path / ".odd.tmp-99999999999999999999").mkdir()  # a pid past any: skipped, not a crash
    (tmp_path / ".ckpt.tmp-99999999999999999999").mkdir()
    write(tmp_path / "ckpt", 1.0)
    err = capsys.readouterr().err
    assert f"note: {left} (3 MiB) is what a writer of {tmp_path / 'other'} that did not finish left" in err
    assert err.count("note:") == 1
    assert left.exists()
    write(tmp_path / "other", 2.0)  # the next writer of that name removes it
    assert not left.exists()
