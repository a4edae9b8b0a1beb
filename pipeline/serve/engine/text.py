"""From generated token ids to text: incremental detokenisation and stop strings.

A token's text can depend on its neighbours (byte-level pieces of one character, SentencePiece's
leading space), so each new token is decoded together with the few tokens before it: the text of
ids[prefix:] minus the text of ids[prefix:read] is what the new tokens add, exact whatever the
decoder does at the start of a sequence, and the window moves on once that text is complete. A
token costs the decoding of a handful of ids, not of the whole output. Only what can no longer
change is released: nothing that ends in an incomplete character, nothing that might be the start
of a stop string. An output that ends inside a character ends without it, as vLLM's does
(`keep_partial` writes it as `tokenizer.decode` does, U+FFFD for its bytes).

`RequestText` is that stream for one request as the engine's tokens come: the HTTP server's
engine client and `pipe generate` both make their text through it, so they release the same text
and stop at the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: detokenising needs no torch
    from pipeline.serve.engine.sampling import SamplingParams

_INCOMPLETE = "\ufffd"  # what decoders give for a partial UTF-8 sequence
CONTEXT_IDS = 5  # prompt ids decoded before the first output token


class TextStream:
    """The text of one request's output, released piece by piece (module docstring)."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: Sequence[str] = (),
        context: Sequence[int] = (),
        include_stop: bool = False,
        keep_partial: bool = False,
    ) -> None:
        """`context`: the ids before the output (the prompt's last few), so that the first
        token's text is what it adds after them: a SentencePiece word keeps its leading space,
        and prompt + output text is the whole text (vLLM's rule too). `include_stop`: the text
        ends after the stop string found, not before it. `keep_partial`: an output that ends
        inside a character ends with U+FFFD for its bytes, as `tokenizer.decode` writes it
        (lm-eval's Hugging Face backend), not without them (vLLM's text: its detokenizer never
        releases a partial character)."""
        self._decode = decode
        self._include_stop = include_stop
        self._keep_partial = keep_partial
        self._stop = [s for s in stop if s]
        context = list(context[-CONTEXT_IDS:]) if context else []
        context_text = decode(context) if context else ""
        if context_text.endswith(_INCOMPLETE):
            context, context_text = [], ""  # the prompt ends inside a character: no clean seam
        self.ids: list[int] = context
        self.text = ""  # released so far
        self.stopped = False
        self._complete = ""  # decoded and whole: released, or held for a stop string
        self._checked = 0  # _complete[:_checked] was looked at (or passed over) for stops
        self._prefix = 0  # ids[_prefix:_read] is the context decoded before the new ids
        self._read = len(context)
        self._prefix_text = context_text

    def push(self, token: int, find_stop: bool = True) -> str:
        """Add a token; the newly released text (sets `stopped` at a stop string, looked for
        only with `find_stop`)."""
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix :])
        if len(window) > len(self._prefix_text) and not window.endswith(_INCOMPLETE):
            self._complete += window[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        cut = self._stop_at(self._complete) if find_stop else None
        self._checked = len(self._complete)
        if cut is not None:
            self.stopped = True
            return self._release(self._complete[:cut])
        safe = len(self._complete) - self._held_for_stop(self._complete)
        return self._release(self._complete[:safe])

    def finish(self) -> str:
        """Everything not yet released (the request ended for another reason); a last
        character left incomplete only with `keep_partial`."""
        if self.stopped:
            return ""
        if not self._keep_partial:
            return self._release(self._complete)
        window = self._decode(self.ids[self._prefix :])
        return self._release(self._complete + window[len(self._prefix_text) :])

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta

    def _stop_at(self, full: str) -> int | None:
        # a stop string counts where it ends in the text not yet looked at (vLLM's rule)
        starts = ((s, max(0, self._checked - len(s) + 1)) for s in self._stop)
        found = [(i, s) for i, s in ((full.find(s, start), s) for s, start in starts) if i >= 0]
        if not found:
            return None
        at, stop = min(found)
        return at + len(stop) if self._include_stop else at

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        return held_prefix(text, self._stop)


def held_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some marker but is not all of it: text to
    hold back in case a marker (a stop string, a tool call's tag) is coming."""
    held = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:size]):
                held = size
                break
    return held


class RequestText:
    """One request's text from the tokens the engine generates for it (module docstring).

    The engine ends a request on token ids only (a stop token, `max_new_tokens`); the stop
    strings are found here, once more than `min_tokens` tokens are out (vLLM's rule). When one
    ends the text first, `stopped_by_text` says so: the engine does not know, and the caller
    must abort the request. `decode(ids, skip_special_tokens)` is the tokenizer's; the
    request's `skip_special_tokens` says whether special tokens are written; `keep_partial`:
    as `TextStream`'s (default: vLLM's text)."""

    def __init__(
        self,
        decode: Callable[[list[int], bool], str],
        params: SamplingParams,
        prompt: Sequence[int],
        keep_partial: bool = False,
    ) -> None:
        skip = params.skip_special_tokens

        def text_of(ids: list[int]) -> str:
            return decode(ids, skip)

        self._stream = TextStream(
            text_of, params.stop, prompt, params.include_stop_str_in_output, keep_partial
        )
        self._stop_token_ids = params.stop_token_ids
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._count = 0
        self.finish_reason: str | None = None
        self.stopped_by_text = False

    @property
    def text(self) -> str:
        """All the text released so far."""
        return self._stream.text

    def add(self, token: int, finish_reason: str | None) -> str:
        """The text `token` releases, given the engine's `finish_reason` for it (None while the
        request goes on). A stop token adds no text of its own; at the end, whatever was held
        back (an incomplete character, a possible stop string's start) is released."""
        self._count += 1
        if token in self._stop_token_ids and not self._include_stop:
            text = ""
        else:
            text = self._stream.push(token, find_stop=self._count > self._min_tokens)
        if self._stream.stopped and finish_reason is None:
            finish_reason, self.stopped_by_text = "stop", True
        if finish_reason is not None:
            text += self._stream.finish()
            self.finish_reason = finish_reason
        return text
