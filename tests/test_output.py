"""Text deltas from the incremental detokenizer, stop strings and stop tokens (real tokenizer)."""
from __future__ import annotations

import pytest

from flotilla.models.tokenizer import load_tokenizer
from flotilla.runtime.sampling import SamplingParams

from fake_executor import scripted_engine


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


def run(tok, text: str, **params):
    script = tok.encode(text, add_special_tokens=False)
    eng = scripted_engine({"r": script}, tok)
    eng.add_request("r", tok.encode("Say something."), SamplingParams(max_tokens=len(script), temperature=0, **params))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return script, outs


def test_deltas_add_up_to_the_decoded_text_and_never_split_a_character(tok):
    text = "Grüße aus Köln! 🚀🎉 naïve café — 東京タワー."
    script, outs = run(tok, text)
    assert "".join(o.text for o in outs) == tok.decode(script) == text
    assert not any("\ufffd" in o.text for o in outs)
    assert any(o.text == "" for o in outs[:-1]), "expected a token that ends inside a character (held back)"
    assert outs[-1].finished and outs[-1].finish_reason == "length"


def test_a_reply_cut_inside_a_character_drops_the_piece_not_a_replacement_character(tok):
    """max_tokens ending between the pieces of a character: the text ends before it (vLLM never emits the
    incomplete character), not in U+FFFD."""
    full = tok.encode("Emoji: 🥳🥴", add_special_tokens=False)
    cut = next(n for n in range(1, len(full)) if tok.decode(full[:n]).endswith("\ufffd"))
    eng = scripted_engine({"r": full[:cut]}, tok)
    eng.add_request("r", tok.encode("Say something."), SamplingParams(max_tokens=cut, temperature=0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "length" and "\ufffd" not in text
    assert text == tok.decode(full[:cut]).rstrip("\ufffd")
    script, outs = run(tok, "Replacement: \ufffd")  # a real U+FFFD at the end stays
    assert "".join(o.text for o in outs) == "Replacement: \ufffd"


def test_a_stop_string_cuts_the_text_and_is_never_streamed(tok):
    script, outs = run(tok, "The answer is 42. END of the story, and more words.", stop=("END", "zebra"))
    text = "".join(o.text for o in outs)
    assert text == "The answer is 42. "
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "END"
    assert sum(len(o.new_token_ids) for o in outs) < len(script)  # generation stopped there


def test_a_stop_string_split_across_tokens(tok):
    script, outs = run(tok, "alpha beta gamma delta epsilon", stop=("ta gam",))
    assert "".join(o.text for o in outs) == "alpha be"
    assert outs[-1].stop_reason == "ta gam"


def test_a_stop_token_ends_the_request_without_its_text(tok):
    text = "One two three four five"
    script = tok.encode(text, add_special_tokens=False)
    stop_id = script[2]
    _, outs = run(tok, text, stop_token_ids=(stop_id,))
    assert [t for o in outs for t in o.new_token_ids] == script[:3]
    assert "".join(o.text for o in outs) == tok.decode(script[:2])
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_id


def test_text_offsets_hold_each_tokens_place_even_while_a_stop_string_holds_text_back(tok):
    """Each token's offset is where the text it completed starts in the output: held text (a stop string's
    look-behind) does not move it, and a token inside a character gets that character's offset."""
    text = "Grüße! 🚀 and more"
    _, plain = run(tok, text)
    _, held = run(tok, text, stop=("XXXXXXXX",))
    assert all(len(out.new_token_ids) == 1 for out in plain)
    want = [sum(len(out.text) for out in plain[:i]) for i in range(len(plain))]  # the text before each delta
    assert want[5:8] == [6, 6, 6]  # " 🚀": its pieces (no text yet) and the token that completes it
    offsets = [o for out in plain for o in out.text_offsets]
    assert offsets == [o for out in held for o in out.text_offsets] == want


def test_include_stop_str_in_output_keeps_stop_strings_and_stop_tokens(tok):
    _, outs = run(tok, "The answer is 42. END of the story.", stop=("END",), include_stop_str_in_output=True)
    assert "".join(o.text for o in outs) == "The answer is 42. END" and outs[-1].stop_reason == "END"
    text = "One two three four five"
    script = tok.encode(text, add_special_tokens=False)
    _, outs = run(tok, text, stop_token_ids=(script[2],), include_stop_str_in_output=True)
    assert "".join(o.text for o in outs) == tok.decode(script[:3]) and outs[-1].stop_reason == script[2]


def test_min_tokens_lets_no_stop_string_end_the_text_before_it(tok):
    script, outs = run(tok, "END one two END three four", stop=("END",), min_tokens=3)
    text = "".join(o.text for o in outs)
    assert text.startswith("END one") and outs[-1].stop_reason == "END" and not text.endswith("END")
