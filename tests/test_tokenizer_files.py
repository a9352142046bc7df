"""Tokenizers read from their files without transformers (models/tokenizer_files.py) give what
transformers gives on the same files: ids, text, special tokens, and chat templates rendered
with the same helpers in the same sandbox."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from conftest import REPO, save_byte_tokenizer
from flotilla.errors import FlotillaError
from flotilla.models.tokenizer import load_tokenizer
from flotilla.models.tokenizer_files import FileTokenizer

TEXTS = ["Hello world", "  two spaces\n\ttab", "émoji 🚀 和中文", "<|im_start|>user\nhi<|im_end|>", "", "a" * 40]
CHATS = [[{"role": "user", "content": "Hi there"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
          {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]]

# transformers' helpers and jinja features: tojson (no HTML escaping), namespace, loop controls,
# a special token, raise_exception, {% generation %}
TEMPLATE = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
            "{% if loop.index > 4 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
            "{% if m['role'] == 'assistant' %}{% generation %}[a]{{ m['content'] }}{% endgeneration %}"
            "{% else %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endif %}\n{% endfor %}"
            "{{ ns.n }}{% if add_generation_prompt %}[a]{% endif %}")


def test_the_default_models_tokenizer_equals_transformers_on_the_same_files(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    assert isinstance(tok.hf, FileTokenizer)
    hf = AutoTokenizer.from_pretrained(str(tok.hf.directory))
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == list(hf.encode(text, add_special_tokens=special)), text
    for chat in CHATS:
        for gen in (True, False):
            assert tok.hf.apply_chat_template(chat, add_generation_prompt=gen) == \
                hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    ids = tok.encode("Hello <|im_end|> world, <|im_start|>")
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert (tok.vocab_size, tok.hf.eos_token_id, tok.hf.special_tokens) == (len(hf), hf.eos_token_id,
                                                                             hf.special_tokens_map)
    # the files quantize copies into a checkpoint load in transformers 4 too: its class name, no loading options
    cfg = json.loads((tok.hf.directory / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["clean_up_tokenization_spaces"] is False
    assert not {"backend", "is_local", "local_files_only"} & set(cfg)
    assert cfg["chat_template"] == (tok.hf.directory / "chat_template.jinja").read_text()


def test_templates_render_as_transformers_renders_them(tmp_path):
    save_byte_tokenizer(tmp_path, TEMPLATE)
    tok, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(tok.hf, FileTokenizer)
    chat = [{"role": "user", "content": 'say "<b>" & é'}] + CHATS[1]  # 5 messages: the template keeps 4
    for gen in (True, False):
        text = tok.hf.apply_chat_template(chat, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert text.startswith('[user]"say \\"<b>\\" & é"') and text.endswith("[a]A4")  # tojson: no HTML, no \\u escapes
    with pytest.raises(FlotillaError, match="the chat template rejected the messages: no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_tokenizer_transformers_would_change_goes_through_transformers(tmp_path):
    save_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert not isinstance(load_tokenizer(tmp_path).hf, FileTokenizer)


def test_loading_the_default_tokenizer_imports_no_transformers(smollm2_gguf):
    load_tokenizer(smollm2_gguf)  # converted once into the cache, as the first run does
    code = ("import sys; from flotilla.models.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(smollm2_gguf)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}]); "
            "print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
