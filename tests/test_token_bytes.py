"""Logprobs' `bytes`: a token holding part of a multi-byte character carries its own raw bytes (OpenAI's
field, so that a client rebuilds split characters), for byte-level BPE and SentencePiece byte fallback."""
from __future__ import annotations

from flotilla.models.tokenizer import Tokenizer, load_tokenizer
from flotilla.server.responses import TokenText, completion_logprobs
from flotilla.server.engine_client import TokenLogprob

TEXT = "🎉 日本 and é"


def test_byte_level_pieces_join_into_the_text(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.decode([i]).count("\ufffd") for i in ids)  # the case: pieces of characters
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == TEXT
    tt = TokenText(tok)
    entries = [tt.entry(i, -0.5) for i in ids]
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == TEXT
    assert entries[0]["token"] == "\ufffd" and entries[0]["bytes"] == [0xF0, 0x9F]
    assert tok.token_bytes(tok.eos_token_ids[0]) == b"<|im_end|>"  # a special token: its text


def test_sentencepiece_byte_fallback_pieces():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1, "▁a": 2, "a": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>"))
    ids = tok.encode("a é", add_special_tokens=False)
    assert [tok._fast.id_to_token(i) for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert [tok.token_bytes(i) for i in ids[-2:]] == [b"\xc3", b"\xa9"]


def test_completion_top_logprobs_keep_the_likelier_of_two_same_texts(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    a, b = tok.encode("🎉", add_special_tokens=False)[1:3]  # two pieces, both "\ufffd" alone
    lp = TokenLogprob(a, -0.1, top=((a, -0.1), (b, -2.0)))
    out = completion_logprobs(TokenText(tok), [lp], [0])
    assert out["top_logprobs"] == [{"\ufffd": -0.1}]
    # the sampled token is in its row even when it is not among the top (up to logprobs + 1 entries)
    out = completion_logprobs(TokenText(tok), [TokenLogprob(b, -2.0, top=((a, -0.1),))], [0])
    assert out["top_logprobs"] == [{"\ufffd": -0.1}] and out["token_logprobs"] == [-2.0]
    c = tok.encode(" the", add_special_tokens=False)[0]
    out = completion_logprobs(TokenText(tok), [TokenLogprob(c, -3.0, top=((a, -0.1),))], [0])
    assert out["top_logprobs"] == [{"\ufffd": -0.1, " the": -3.0}]


def test_byte_level_inside_a_decoder_sequence():
    from tokenizers import decoders

    from flotilla.models.tokenizer import _byte_level

    assert _byte_level(decoders.ByteLevel()) and _byte_level(decoders.Sequence([decoders.ByteLevel()]))
    assert not _byte_level(decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])) and not _byte_level(None)
