"""A GGUF source (the real SmolLM2-135M): its tokenizer and chat template carried into the
checkpoint, tied embeddings kept tied, INT8 logits close to the source's. And quantize's
dependency rule: it never imports the runtime or the server."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from flotilla.models.attention import DenseCausalAttention
from flotilla.models.sources import open_source
from flotilla.models.tokenizer import load_tokenizer
from flotilla.models.weights import load_stage
from flotilla.quantize import QuantizeOptions, quantize_model

from quantize_helpers import cli_env


def test_smollm2_gguf_to_int8_checkpoint(smollm2_gguf, tmp_path):
    out = tmp_path / "smollm2-int8"
    report = quantize_model(smollm2_gguf, out, QuantizeOptions(bits=8, method="rtn", group_size=64), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["quantization_config"]["bits"] == 8
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "model.embed_tokens.weight" in index
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = load_tokenizer(out)
    assert tok.has_chat_template and tok.encode("Hello world") == load_tokenizer(smollm2_gguf).encode("Hello world")
    assert report.fp16_bytes / report.out_bytes > 1.4  # INT8 layers, fp16 embeddings

    ids = torch.tensor(tok.encode("The GNU General Public License is a free, copyleft license for software."))
    L = len(ids)

    def logits(path):
        model = load_stage(open_source(path))
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(L), DenseCausalAttention(1, L)))

    ref, got = logits(smollm2_gguf), logits(out)
    assert float((got - ref).norm() / ref.norm()) < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_quantize_imports_neither_runtime_nor_server():
    code = ("import sys, flotilla.quantize.cli, flotilla.quantize.pipeline; "
            "bad = [m for m in sys.modules if m.startswith(('flotilla.runtime', 'flotilla.server'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
