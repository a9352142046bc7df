"""A reasoning model's `<think>…</think>` block apart from its answer (`serve --reasoning-parser`), as vLLM's
reasoning parsers give it: chat messages and deltas carry the block's text as `reasoning` (and, under its
older name, `reasoning_content`) and the rest as `content`.

    deepseek_r1  the reply starts inside the block (DeepSeek-R1 and its distills, QwQ: their templates open
                 it in the prompt); a `<think>` the model writes anyway is dropped; with no `</think>` the
                 whole reply is reasoning
    qwen3        the reply is reasoning from a `<think>` it starts with (Qwen3 with thinking on), or from its
                 start where the prompt ends in `<think>` (the Thinking-2507 models' templates); with
                 `enable_thinking: false` (no block) it is all content

The tags are found in the text as it streams: a piece of a tag at a delta's end is held back until the
next text says whether it is one, so a tag is never split across deltas nor shown. The text after
`</think>` is the content as it is (its leading newlines too, as vLLM gives them).
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 4  # the prompt's last tokens that say whether its template opened (or closed) the block


def prompt_end(tokenizer, prompt: list[int]) -> str:
    """A chat prompt's last text, its special tokens included (a template may open the <think> block)."""
    return tokenizer.decode(list(prompt[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)


class ReasoningSplitter:
    """One choice's text, fed delta by delta: `feed` returns (reasoning, content) deltas, `finish` the rest."""

    def __init__(self, parser: str, prompt_end: str = ""):
        """`prompt_end`: the rendered prompt's last text (a template may open the block, or close it)."""
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self.state = "opening"  # before the reply's first characters say whether it opens a block
        end = prompt_end.rstrip()
        if end.endswith(START):
            self.state = "reasoning"
        elif end.endswith(END) and parser == "qwen3":  # the template closed it (enable_thinking false)
            self.state = "content"
        self.held = ""  # text not yet given out (a possible piece of a tag)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "opening":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state = stripped[len(START):], "reasoning"
                    continue
                if START.startswith(stripped):  # "", "<", "<thi": not yet known
                    return reasoning, content
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                continue
            if self.state == "reasoning":
                i = self.held.find(END)
                if i >= 0:
                    reasoning += self.held[:i]
                    self.held, self.state = self.held[i + len(END):], "content"
                    continue
                keep = _partial_suffix(self.held, END)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            text, self.held = self.held, ""  # content: everything
            return reasoning, content + text

    def finish(self) -> tuple[str, str]:
        """What is still held back at the end: a tag's piece that never became one is text."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "opening":  # a reply shorter than "<think>" that is a piece of it
            return (held, "") if self.parser == "deepseek_r1" else ("", held)
        return "", held


def split_reasoning(parser: str, text: str, prompt_end: str = "") -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content); None for a part that is empty (as vLLM gives them)."""
    s = ReasoningSplitter(parser, prompt_end)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag` (shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
