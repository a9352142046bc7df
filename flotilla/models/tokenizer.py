"""Tokenizer, chat template and incremental detokenization.

Loaded from `tokenizer.json` + `tokenizer_config.json` in a model directory, or from the
metadata of a GGUF file (converted once by transformers and cached next to flotilla's other
cached files, since the conversion takes seconds). Files that transformers would load as they
are go through `tokenizer_files` (no transformers import); others through transformers. Never
touches a model hub.
"""
from __future__ import annotations

import codecs
import functools
import hashlib
import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from flotilla.envs import cache_dir  # noqa: E402
from flotilla.errors import FlotillaError  # noqa: E402

from .tokenizer_files import FileTokenizer, loads_as_is  # noqa: E402


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        self._fast = getattr(hf_tokenizer, "_tokenizer", None)  # the Rust tokenizers object
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self.vocab_size = len(hf_tokenizer)
        self._pieces: dict[int, str] = {}  # decode([id]) per id, as streaming asks for it again and again

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def set_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja, as a tokenizer_config's; `read_chat_template` checked it) instead of
        the model's own."""
        self.hf.chat_template = template
        if hasattr(self.hf, "_template"):  # FileTokenizer's compiled one
            self.hf._template = None

    def special_token(self, name: str) -> str | None:
        """A special token's text by its tokenizer_config name (bos_token, eos_token, pad_token, ...), or None."""
        special = getattr(self.hf, "special_tokens", None)  # FileTokenizer's
        token = special.get(name) if isinstance(special, dict) else getattr(self.hf, name, None)
        return None if token is None else str(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_window(self, ids: list[int]) -> str:
        """`decode(ids)` of a detokenizer's window; one-token windows (the usual case) come from a cache."""
        if len(ids) != 1:
            return self.decode(ids)
        piece = self._pieces.get(ids[0])
        if piece is None:
            piece = self._pieces[ids[0]] = self.decode(ids)
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens as their text): a token holding part of a multi-byte
        character, whose decode alone is U+FFFD, gives its own bytes (byte-level BPE's mapped characters,
        SentencePiece's <0xNN> byte-fallback pieces), so that a client joining them rebuilds the text."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text or self._fast is None:
            return text.encode("utf-8")
        piece = self._fast.id_to_token(token_id) or ""
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if _byte_level(self._fast.decoder):
            table = _byte_level_decoder()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return text.encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The conversation as the model's template renders it, encoded. `continue_final_message`:
        the text ends inside the last message (an assistant turn the model continues), cut right
        after its content, as vLLM and transformers do. `template_kwargs`: more variables for the
        template (e.g. a model's `enable_thinking`)."""
        if not self.has_chat_template:
            raise FlotillaError("this model's tokenizer has no chat template; use plain completions")
        final = messages[-1]["content"].strip() if messages else ""
        if continue_final_message and (add_generation_prompt or not final):
            raise FlotillaError("continue_final_message needs add_generation_prompt false and a last message "
                                "with content to continue")
        named = [k for k in template_kwargs or {} if k in _named_parameters(self.hf.apply_chat_template)]
        if named:  # the renderer's own options (a template of the request's, say): never the request's to set
            raise FlotillaError(f"{named[0]!r} is an option of the renderer, not a template variable")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **(template_kwargs or {}))
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise FlotillaError(f"the chat template rejected the messages: {e}") from None
        if continue_final_message:  # the content stripped, as transformers cuts it (templates that trim it)
            end = text.rfind(final)
            if end < 0:
                raise FlotillaError("the chat template changed the last message's text, so it cannot be continued")
            text = text[:end + len(final)]
        return self.encode(text, add_special_tokens=False)

    def save(self, directory: Path) -> None:
        self.hf.save_pretrained(str(directory))

    def detokenizer(self, prompt_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids or [])


def _named_parameters(function) -> frozenset[str]:
    """The parameters a callable names (its **kwargs aside)."""
    import inspect

    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character.

    Decodes a small window (from `prefix` to the end) and emits only what the window adds beyond
    the text already emitted; a window ending in U+FFFD (an incomplete byte sequence) waits."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode_window(self.ids[self.prefix:self.read])
        full_text = self.tok.decode_window(self.ids[self.prefix:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end, less a last character that its bytes never completed (a
        reply cut by max_tokens inside a character: dropped, as vLLM never emits it, not shown as U+FFFD; a
        real U+FFFD in the text stays)."""
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full_text = self.tok.decode(self.ids[self.prefix:])
        held = self.ids[self.read:]
        self.prefix = self.read = len(self.ids)
        delta = full_text[len(prefix_text):]
        if delta.endswith("\ufffd") and _ends_incomplete(b"".join(self.tok.token_bytes(t) for t in held)):
            delta = delta[:-1]
        return delta


def _ends_incomplete(raw: bytes) -> bool:
    """Whether these bytes end inside a UTF-8 character (its first bytes, the rest never came)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(raw, final=False)
    return bool(decoder.getstate()[0])


def load_tokenizer(path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    p = Path(path).expanduser()
    if p.is_file():
        return Tokenizer(_gguf_tokenizer(p), eos_token_ids)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer.model").is_file():
        raise FlotillaError(f"{p}: no tokenizer.json (the model directory needs its tokenizer files)")
    try:
        hf = _from_directory(p)
    except Exception as e:
        raise FlotillaError(f"{p}: cannot load the tokenizer ({e})") from None
    return Tokenizer(hf, eos_token_ids + _generation_eos(p))


def _from_directory(directory: Path):
    """The files as they are (tokenizers + jinja2) where transformers would load them unchanged,
    else transformers' AutoTokenizer."""
    if loads_as_is(directory):
        return FileTokenizer(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _generation_eos(directory: Path) -> tuple[int, ...]:
    f = directory / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return ()
    return tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())


def _byte_level(decoder) -> bool:
    """Whether a tokenizers decoder is byte-level BPE's, alone or inside a Sequence."""
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no decoder, or one without a JSON state: not byte-level
        return False
    return state.get("type") == "ByteLevel" or any(d.get("type") == "ByteLevel" for d in state.get("decoders", ()))


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (GPT-2's: printable bytes as themselves, the others
    shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


PORTABLE = 2  # the cache's form: 2 = tokenizer_config.json as portable_config writes it
LOAD_OPTIONS = ("backend", "is_local", "local_files_only")  # transformers 5 writes how it loaded the files


def portable_config(directory: Path) -> None:
    """tokenizer_config.json as transformers 4 and 5 both load it (quantize copies it into checkpoints that
    other tools load): the generic class under its transformers-4 name (`TokenizersBackend` does not exist
    there; transformers 5 reads `PreTrainedTokenizerFast` as the same class), no loading options, no
    clean-up of spaces on decode (transformers 5 never does it; 4 would by default), and the chat template
    inside too (transformers 4 before chat_template.jinja files)."""
    path = directory / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in LOAD_OPTIONS:
        cfg.pop(key, None)
    cfg.setdefault("clean_up_tokenization_spaces", False)
    template = directory / "chat_template.jinja"
    if "chat_template" not in cfg and template.is_file():
        cfg["chat_template"] = template.read_text()
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _gguf_tokenizer(path: Path):
    st = path.stat()
    key = hashlib.sha1(f"{PORTABLE}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").is_file():
        return _from_directory(cached)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise FlotillaError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    try:
        tmp = cached.with_name(cached.name + f".tmp-{os.getpid()}")
        hf.save_pretrained(str(tmp))
        portable_config(tmp)
        os.replace(tmp, cached)
    except OSError:
        return hf  # a read-only cache only costs the conversion next time
    return _from_directory(cached)  # as every later run will read it


def check_chat_template(template: str, where: str = "--chat-template") -> None:
    """A FlotillaError naming the line where `template` is not valid Jinja."""
    import jinja2

    from .tokenizer_files import _compile

    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise FlotillaError(f"{where}: line {e.lineno}: {e.message}") from None


def read_chat_template(value: str) -> str:
    """--chat-template's value, as vLLM reads its own: a file holding the template, else the template itself
    (where it has Jinja's {{ or {%); checked before any model loads."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a long inline template: a name too long for the file system
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FlotillaError(f"--chat-template {value}: cannot read it: {e}") from None
        if path.suffix == ".json":  # chat_template.json, as transformers writes it
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise FlotillaError(f"--chat-template {value}: expected a JSON object with a \"chat_template\" "
                                    "string") from None
        where = f"--chat-template {value}"
    elif "{{" in value or "{%" in value:
        text, where = value, "--chat-template"
    else:
        raise FlotillaError(f"--chat-template {value}: no such file, and not a Jinja template (one has {{{{ or {{%)")
    if not isinstance(text, str) or not text.strip():
        raise FlotillaError(f"{where}: the template is empty")
    check_chat_template(text, where)
    return text
