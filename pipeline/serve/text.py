"""From generated token ids to text: incremental detokenisation and stop strings.

Text is re-decoded from all of a request's ids at each token (a token's text can depend on its
neighbours: byte-level pieces of one character, SentencePiece's leading space), and only what can
no longer change is released: nothing that ends in an incomplete character, nothing that might be
the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what decoders give for a partial UTF-8 sequence


class TextStream:
    """The text of one request's output, released piece by piece (module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; the newly released text (sets `stopped` at a stop string)."""
        self.ids.append(token)
        full = self._decode(self.ids)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        safe = len(full.rstrip(_INCOMPLETE))
        safe -= self._held_for_stop(full[:safe])
        return self._release(full[:safe])

    def finish(self) -> str:
        """Everything not yet released (the request ended for another reason)."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.ids))

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta

    def _stop_at(self, full: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        found = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
