"""A tokenizer read straight from `tokenizer.json` with the `tokenizers` library, and its chat
template rendered with jinja2, without importing transformers (whose import and second copy of
the tokenizer cost ~50 MB of a small model's RSS).

Used only for the files transformers itself loads as they are: `tokenizer_class` is the generic
`TokenizersBackend` / `PreTrainedTokenizerFast` and the config asks for no changes to the
tokenizer (`add_bos_token`, …); anything else goes through transformers. It offers the part of a
transformers tokenizer's interface that `tokenizer.Tokenizer` uses, and the template sees what
transformers' `apply_chat_template` passes it (messages, tools, documents,
add_generation_prompt and the named special tokens) in the same sandbox.
"""
from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
CHANGES = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
         "special_tokens_map.json")


def loads_as_is(directory: Path) -> bool:
    """Whether transformers would load this directory's tokenizer.json unchanged."""
    cfg_file = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not cfg_file.is_file():
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return cfg.get("tokenizer_class") in GENERIC_CLASSES and not any(k in cfg for k in CHANGES)


class FileTokenizer:
    """tokenizer.json + tokenizer_config.json (+ the chat template file) of one directory."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.directory = directory
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg = json.loads((directory / "tokenizer_config.json").read_text())
        self.special_tokens = {k: _content(cfg[k]) for k in SPECIAL if cfg.get(k) is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tokenizer.token_to_id(eos) if eos is not None else None
        self.chat_template = _chat_template(directory, cfg)
        self._template = None

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, **variables) -> str:
        """`variables`: more names for the template (a request's chat_template_kwargs); they never
        replace the messages, the generation flag or the special tokens."""
        assert not tokenize, "renders text; Tokenizer.apply_chat_template encodes it"
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render({**variables, "messages": messages, "tools": None, "documents": None,
                                      "add_generation_prompt": add_generation_prompt, **self.special_tokens})

    def save_pretrained(self, directory: str) -> None:
        for name in FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(directory) / name)


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(directory: Path, cfg: dict) -> str | None:
    """The template as transformers finds it: chat_template.jinja, chat_template.json, then the
    config (a list of named templates: the one named "default")."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "chat_template.json").is_file():
        return json.loads((directory / "chat_template.json").read_text()).get("chat_template")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _compile(template: str):
    """The template in jinja2's immutable sandbox with transformers' settings and helpers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (marks assistant text for training masks): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own tojson, which escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
