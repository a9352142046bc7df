"""Per-request outputs: token ids, text deltas from an incremental detokenizer, stop strings.

Stop strings are searched in the generated text; the text is cut before the stop string, which is
never emitted (unless the request asks for it: vLLM's include_stop_str_in_output). While a request
has stop strings, the last (longest stop string - 1) characters are held back, so a stop string
split across steps is never half streamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.models.tokenizer import IncrementalDetokenizer, Tokenizer

from .sequence import FinishReason, Sequence


@dataclass
class RequestOutput:
    """What one step (or an abort) produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the new text (a delta); never splits a UTF-8 character
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[float] | None = None  # per new token, when asked for
    text_offsets: list[int] | None = None  # per new token: where the text it completed starts in the output
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    queue_time: float | None = None  # seconds from its arrival in the engine to its first admission
    error: str | None = None  # why the engine had to end the request (e.g. a pipeline stage stayed down)
    # on the first output after the prompt, when asked for (SamplingParams.prompt_logprobs): per prompt
    # position, None at 0, then (logprob, rank, [(token id, logprob) of the likeliest]) of the token there
    prompt_logprobs: list | None = None

    def extend(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by a later one of the same request and step (a speculative step
        yields several tokens): one output with both's tokens and text, and the later's state."""
        self.new_token_ids += later.new_token_ids
        self.text += later.text
        if later.text_offsets is not None:
            self.text_offsets = (self.text_offsets or []) + later.text_offsets
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
            self.top_logprobs = (self.top_logprobs or []) + (later.top_logprobs or [])
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        return self


class TextState:
    """The detokenizer and stop-string state of one request."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence):
        self.detok: IncrementalDetokenizer = tokenizer.detokenizer(seq.prompt_token_ids)
        self.stops = tuple(s for s in seq.params.stop if s)
        self.keep_stop = seq.params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # generated text so far (cut at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.offset = 0  # where the last token's text starts in self.text (a piece of a character: where it will)

    def add(self, token_id: int, is_stop_token: bool, may_stop: bool = True) -> tuple[str, str | None]:
        """Feed one token; returns (text delta, the stop string found or None). `may_stop` false (the
        request is short of its min_tokens, as vLLM counts them): no stop string ends the text."""
        self.offset = len(self.text)
        if not is_stop_token:  # a stop token's own text is not part of the output
            start = max(0, len(self.text) - self.hold)
            self.text += self.detok.add(token_id)
            hit = self._find_stop(start) if may_stop else None
            if hit is not None:
                self.offset = min(self.offset, len(self.text))  # the cut may fall before this token's text
                return self._emit(final=True), hit
        return self._emit(final=False), None

    def finish(self) -> str:
        self.text += self.detok.flush()
        return self._emit(final=True)

    def _find_stop(self, start: int) -> str | None:
        best = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.keep_stop else 0)]
        return best[1]

    def _emit(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


class OutputProcessor:
    """Turns sampled tokens into RequestOutputs; decides stop-string finishes."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.states[seq.request_id] = TextState(self.tokenizer, seq)

    def token(self, seq: Sequence, token_id: int, reason: FinishReason | None,
              logprob: float | None = None, top: list | None = None) -> tuple[RequestOutput, FinishReason | None]:
        """The output for one new token of `seq` (already appended); returns it with the finish
        reason, which a stop string may set."""
        out = RequestOutput(seq.request_id, [token_id], num_prompt_tokens=seq.num_prompt_tokens,
                            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                            queue_time=_queue_time(seq))
        if logprob is not None:
            out.logprobs, out.top_logprobs = [logprob], [top or []]
        state = self.states.get(seq.request_id)
        if reason is FinishReason.STOP and token_id not in seq.eos_token_ids:
            out.stop_reason = token_id  # a stop token's id; None for the model's eos (checked first, as vLLM)
        if state is not None:
            # a stop token's text is left out, unless the request keeps its stop strings (vLLM's option)
            out.text, hit = state.add(token_id, reason is FinishReason.STOP
                                      and not (seq.params.include_stop_str_in_output and out.stop_reason is not None),
                                      seq.num_output_tokens > seq.params.min_tokens)
            out.text_offsets = [state.offset]
            if hit is not None:
                reason, out.stop_reason = FinishReason.STOP, hit
            elif reason is not None:
                out.text += state.finish()
        if reason is not None:
            self._finish(out, reason)
        return out, reason

    def prompt_only(self, seq: Sequence) -> RequestOutput:
        """The output of a request for no tokens (max_tokens 0), finished once its prompt is computed."""
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=0,
                            num_cached_tokens=seq.num_cached_tokens, queue_time=_queue_time(seq))
        self._finish(out, FinishReason.LENGTH)
        return out

    def aborted(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                            queue_time=_queue_time(seq))
        self._finish(out, FinishReason.ABORT)
        return out

    def _finish(self, out: RequestOutput, reason: FinishReason) -> None:
        out.finished, out.finish_reason = True, reason.value
        self.states.pop(out.request_id, None)


def _queue_time(seq: Sequence) -> float | None:
    return None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
