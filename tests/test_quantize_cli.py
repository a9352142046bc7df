"""The `quantize` command end to end: bad input, a kill mid-write, the runtime loading the result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flotilla.errors import FlotillaError
from flotilla.models.sources import open_source
from flotilla.quantize.cli import main as quantize_main

from quantize_helpers import cli_env, quantize_cli, run_cli, tiny_model_dir

FAST = ["--calib-samples", "2", "--calib-seq-len", "16"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("src") / "tiny", seed=5)


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def assert_one_line_error(err: str, *fragments: str, progress: bool = False) -> None:
    """stderr is one `error: ...` line (after progress-bar redraws, when the command shows them)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if progress:
        lines = [line for line in lines if "tensor/s" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# ------------------------------------------------------------------------------------- bad input

def _missing_tensor_source(src: Path, tmp: Path) -> Path:
    broken = tmp / "broken"
    broken.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return broken


BAD_INPUTS = {
    # case: (extra args, fragments of the message)
    "unknown-bits": (["--bits", "3"], ["--bits 3", "4, 8"]),
    "bad-group-size": (["--group-size", "100"], ["--group-size 100", "-1 (per channel)", "multiple of 16"]),
    "empty-calib-text": (["--calib", "{tmp}/empty.txt"], ["holds no text"]),
    "empty-calib-jsonl": (["--calib", "{tmp}/empty.jsonl"], ["holds no text"]),
    "missing-tensor": (["--src", "{broken}"], ["model.layers.1.mlp.up_proj.weight", "missing"]),
    "out-not-writable": (["--out", "/sys/flotilla-quantize-out"], ["not writable"]),
    "out-deep-not-writable": (["--out", "/sys/flotilla-quantize/runs/out"], ["/sys: not writable"]),
    "out-under-a-file": (["--out", "{tmp}/empty.txt/runs/out"], ["empty.txt: not a directory"]),
    "out-exists": (["--out", "{tmp}/exists"], ["already exists", "--force"]),
    "out-inside-the-source": (["--out", "{src}/out"], ["inside the source model", "outside the source model"]),
    "out-deep-inside-the-source": (["--out", "{tmp}/link/sub/out"], ["inside the source model"]),  # via a symlink
    "act-order-rtn": (["--method", "rtn", "--act-order"], ["--act-order needs --method gptq"]),
    "desc-act-rtn": (["--method", "rtn", "--desc-act"], ["--act-order needs --method gptq"]),  # GPTQ's name for it
    "rotate-scope-alone": (["--rotate-scope", "r1"], ["--rotate-scope needs --rotate"]),
    "keep-no-pattern": (["--keep", "8"], ["expected BITS:PATTERN"]),
    "keep-narrower": (["--keep", "4:.*"], ["more than --bits 4"]),
    "keep-splits-a-merged-linear": (["--keep", "8:.*q_proj"], ["q_proj but not k_proj, v_proj", "share their bits"]),
    "keep-bad-regex": (["--keep", "8:("], ["not a regular expression"]),
    "calib-longer-than-the-context": (["--calib-seq-len", "100000"], ["--calib-seq-len 100000", "context"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(case, src, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n{"text": "   "}\n')
    (tmp_path / "exists").mkdir()
    (tmp_path / "link").symlink_to(src)
    args, fragments = BAD_INPUTS[case]
    subs = {"tmp": tmp_path, "src": src,
            "broken": _missing_tensor_source(src, tmp_path) if case == "missing-tensor" else ""}
    args = [a.format(**subs) for a in args]
    source = str(src)
    out = str(tmp_path / "out")
    if "--src" in args:
        source = args[args.index("--src") + 1]
        del args[args.index("--src"):args.index("--src") + 2]
    if "--out" in args:
        out = args[args.index("--out") + 1]
        del args[args.index("--out"):args.index("--out") + 2]
    before, source_files = listing(tmp_path), listing(src)
    capsys.readouterr()  # drop what building the fixtures printed
    code = quantize_main([source, "-o", out, "--quiet", *FAST, *args])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, *fragments)
    assert listing(tmp_path) == before  # no OUT, no temporary or probe directory
    assert listing(src) == source_files
    if case == "out-exists":
        assert listing(tmp_path / "exists") == set()


def test_bad_flag_from_the_shell_is_one_line_exit_2(src, tmp_path):
    proc = quantize_cli(src, "-o", tmp_path / "out", "--bits", "four")
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "--bits", "four")
    proc = quantize_cli(src, "-o", tmp_path / "out", "--bits", "3")
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "--bits 3")
    assert listing(tmp_path) == set()


# ------------------------------------------------------------------------------------ kill mid-write

def test_killed_mid_write_leaves_nothing_that_loads(tmp_path):
    src = tiny_model_dir(tmp_path / "src", seed=7, num_hidden_layers=6, hidden_size=256, intermediate_size=1024)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "flotilla.quantize.cli", str(src), "-o", str(out), "--quiet", "--shard-size", "1",
           "--calib-samples", "8", "--calib-seq-len", "64"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while not list(tmp_path.glob(".out.tmp-*/shard-*.safetensors")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no shard appeared"
            time.sleep(0.005)
        proc.kill()
    finally:
        proc.wait()
    assert proc.returncode == -9  # killed, not finished
    assert not out.exists()
    with pytest.raises(FlotillaError):
        open_source(out)
    assert list(tmp_path.glob(".out.tmp-*"))  # the killed run's temporary directory, hidden
    # the next run into the same OUT succeeds and sweeps the dead run's temporary directory away
    done = quantize_cli(src, "-o", out, "--quiet", "--method", "rtn")
    assert done.returncode == 0, done.stderr
    assert open_source(out).config.quant.method == "rtn"
    assert not list(tmp_path.glob(".out.tmp-*"))


# --------------------------------------------------------------------------------- runtime loading

def test_runtime_generates_from_the_checkpoint_and_names_a_bad_shard(src, tmp_path):
    out = tmp_path / "q"
    proc = quantize_cli(src, "-o", out, "--group-size", "32", "--shard-size", "60KB", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "smaller than fp16" in proc.stdout and "peak RSS" in proc.stdout
    gen = run_cli("flotilla.runtime.cli", "generate", out, "--prompt", "hello", "--max-tokens", "6",
                  "--device", "cpu")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip()  # six sampled byte tokens, decoded

    shards = json.loads((out / "flotilla.json").read_text())["shards"]
    assert len(shards) > 1
    victim = out / shards[1]["file"]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped
    victim.write_bytes(bytes(data))
    bad = run_cli("flotilla.runtime.cli", "generate", out, "--prompt", "hello", "--max-tokens", "2")
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, shards[1]["file"], "sha256", progress=True)
    victim.write_bytes(bytes(data[:-100]))  # truncated
    bad = run_cli("flotilla.runtime.cli", "generate", out, "--prompt", "hello", "--max-tokens", "2")
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, shards[1]["file"], "truncated", progress=True)


def test_force_replaces_an_existing_checkpoint(src, tmp_path):
    out = tmp_path / "q"
    assert quantize_main([str(src), "-o", str(out), "--quiet", "--method", "rtn", "--bits", "8"]) == 0
    assert open_source(out).config.quant.bits == 8
    assert quantize_main([str(src), "-o", str(out), "--quiet", "--method", "rtn", "--force"]) == 0
    assert open_source(out).config.quant.bits == 4
    assert listing(tmp_path) == {"q"}
    assert os.access(next(out.glob("model-*.safetensors")), os.R_OK)


def test_the_outputs_missing_parents_are_made(src, tmp_path):
    out = tmp_path / "runs" / "today" / "q"  # as mkdir -p, once the writing starts
    assert quantize_main([str(src), "-o", str(out), "--quiet", "--method", "rtn", "--bits", "3"]) == 2
    assert not (tmp_path / "runs").exists()  # a refused run makes nothing
    assert quantize_main([str(src), "-o", str(out), "--quiet", "--method", "rtn", "--bits", "8"]) == 0
    assert open_source(out).config.quant.bits == 8


def test_force_never_replaces_a_directory_that_is_not_a_checkpoint(src, tmp_path, monkeypatch, capsys):
    """--force replaces an empty directory or a model checkpoint; a directory of other files, one with
    subdirectories beside a model, the current directory and the source's own directory are refused
    with one line that says why, and nothing in them is touched."""
    other = tmp_path / "other"
    (other / "keep").mkdir(parents=True)
    (other / "keep" / "data.txt").write_text("precious")
    hf = tmp_path / "hf"
    (hf / "notes").mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    here = tmp_path / "here"
    here.mkdir()
    (here / "x.txt").write_text("x")
    monkeypatch.chdir(here)
    for out, words in ((other, ["not a model checkpoint", "keep"]), (hf, ["holds directories", "notes"]),
                       (Path("."), ["current"]), (src, ["holds the source"])):
        assert quantize_main([str(src), "-o", str(out), "--quiet", "--method", "rtn", "--force"]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words) and "Traceback" not in err, err
    assert (other / "keep" / "data.txt").read_text() == "precious" and (hf / "notes").is_dir()
    assert (here / "x.txt").is_file() and open_source(src).config is not None
    inside = tmp_path / "ckpt"
    (inside / "sub").mkdir(parents=True)
    (inside / "flotilla.json").write_text("{}")
    monkeypatch.chdir(inside / "sub")
    assert quantize_main([str(src), "-o", "..", "--quiet", "--method", "rtn", "--force"]) == 2  # holds the cwd
    assert "holds the current directory" in capsys.readouterr().err and (inside / "sub").is_dir()
    monkeypatch.chdir(here)
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    for name in ("config.json", "firmware.bin", "notes.txt"):
        (project / name).write_text("x")
    assert quantize_main([str(src), "-o", str(project), "--quiet", "--method", "rtn", "--force"]) == 2
    assert "not a model checkpoint" in capsys.readouterr().err and (project / "notes.txt").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".DS_Store").write_bytes(b"")
    assert quantize_main([str(src), "-o", str(empty), "--quiet", "--method", "rtn", "--force"]) == 0
    gptq = tmp_path / "gptq"  # a Hugging Face GPTQ download: its card, git and hub files beside the model
    (gptq / ".cache" / "huggingface").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "README.md", ".gitattributes"):
        (gptq / name).write_text("x")
    assert quantize_main([str(src), "-o", str(gptq), "--quiet", "--method", "rtn", "--force"]) == 0
    assert (gptq / "flotilla.json").is_file() and not (gptq / "README.md").exists()


# ------------------------------------------------------------------------------- no -o: a default

def test_without_out_the_card_form_writes_beside_the_source(tmp_path):
    src = tiny_model_dir(tmp_path / "model", seed=9)
    proc = subprocess.run([sys.executable, "-m", "flotilla.quantize.cli", "--bits", "4", f"{src}/"],
                          capture_output=True, text=True, env=cli_env(), timeout=300)  # the design card's form
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "model-gptq-int4"
    assert f"writing the checkpoint to {out}" in proc.stdout.splitlines()[0]
    assert "sampling 128 x 128 tokens from the model itself (--calib FILE skips this; so does --method rtn without --sensitive)" in proc.stderr
    assert listing(tmp_path) == {"model", "model-gptq-int4"}
    cfg = open_source(out).config
    assert (cfg.quant.bits, cfg.quant.method, cfg.quant.group_size) == (4, "gptq", 128)
    again = quantize_main([str(src), "--quiet", "--method", "rtn", "--bits", "8"])  # method and bits in the name
    assert again == 0 and open_source(tmp_path / "model-rtn-int8").config.quant.bits == 8


def test_without_out_a_source_that_is_not_a_model_gets_its_error_alone(tmp_path, capsys):
    """Where the checkpoint would go is said only once SRC is known to be a model: a missing path, a file
    that is not a .gguf and a directory without weights each print their one error line, nothing else."""
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for name, words in (("nope", "no such file or directory"), ("notes.txt", "not a model"),
                        ("empty", "no config.json")):
        assert quantize_main([str(tmp_path / name), "--quiet", "--method", "rtn"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "", captured.out
        assert_one_line_error(captured.err, str(tmp_path / name), words)
    assert listing(tmp_path) == {"notes.txt", "empty"}


def test_default_out_of_a_gguf_file_is_its_name_beside_it(tmp_path):
    from flotilla.quantize.cli import default_out
    from flotilla.quantize.options import QuantizeOptions

    assert default_out(tmp_path / "SmolLM2.Q4_1.gguf", QuantizeOptions()) == tmp_path / "SmolLM2.Q4_1-gptq-int4"
    assert default_out(Path("~/m/Llama"), QuantizeOptions(bits=8)) == Path.home() / "m" / "Llama-gptq-int8"


def test_default_out_of_dot_and_dotdot_names_the_directory(tmp_path, monkeypatch):
    from flotilla.quantize.cli import default_out
    from flotilla.quantize.options import QuantizeOptions

    inner = tmp_path / "Llama" / "sub"
    inner.mkdir(parents=True)
    (tmp_path / "blob").write_bytes(b"")
    (tmp_path / "model.gguf").symlink_to(tmp_path / "blob")
    monkeypatch.chdir(tmp_path / "Llama")
    assert default_out(Path("."), QuantizeOptions()) == tmp_path / "Llama-gptq-int4"
    monkeypatch.chdir(inner)
    assert default_out(Path(".."), QuantizeOptions(bits=8)) == tmp_path / "Llama-gptq-int8"
    assert default_out(Path("../../model.gguf"), QuantizeOptions()) == tmp_path / "model-gptq-int4"


def test_options_this_run_does_not_use_are_said_and_a_short_calibration_text_too(tmp_path, capsys):
    """--calib and --damp-percent with --method rtn change nothing: a note says so (the run goes on); a --calib text
    shorter than --calib-samples x --calib-seq-len is said with the tokens it gives."""
    src = tiny_model_dir(tmp_path / "model", seed=9)
    calib = tmp_path / "short.txt"
    calib.write_text("a short calibration text")
    assert quantize_main([str(src), "-o", str(tmp_path / "r"), "--quiet", "--method", "rtn", "--calib", str(calib),
                          "--calib-samples", "4", "--damp-percent", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "note: --calib, --calib-samples ignored: --method rtn reads no calibration text" in err
    assert "note: --damp-percent ignored" in err
    assert quantize_main([str(src), "-o", str(tmp_path / "g"), "--quiet", "--calib", str(calib),
                          "--calib-samples", "4", "--calib-seq-len", "64"]) == 0
    err = capsys.readouterr().err
    assert "of the 4 x 64 = 256 asked for (--calib-samples x --calib-seq-len)" in err and "ignored" not in err
