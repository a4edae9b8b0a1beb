"""Reasoning models' thinking apart from their answer: `pipe serve --reasoning-parser NAME`,
and GRPO's rewards on a thinking policy (`grpo.reasoning_parser`). Pure text and token ids,
so the server and training both use it.

A thinking model writes its reasoning between two marker tokens (`<think>` ... `</think>` for
Qwen3, DeepSeek-R1 and GLM-4.5; `[THINK]` ... `[/THINK]` for Mistral's Magistral). With a parser
the chat reply's `reasoning` (and `reasoning_content`, the older name many clients read) holds
the thinking and `content` the rest, whole or streamed, as vLLM's parsers of the same names
split them (checked against vLLM's own in tests/serve/test_reasoning.py). The markers themselves
appear in neither.

The formats differ in where the reply starts and what the chat template's `enable_thinking`
does:

- `qwen3`, `glm45`: the reply starts inside the reasoning (their templates open `<think>` in
  the prompt, or the model writes it, which is dropped); `enable_thinking: false` turns the
  split off, the whole reply is content. Qwen3 also ends the reasoning at a `<tool_call>` (kept
  in the content for the tool parser); GLM drops the whitespace that ends the reasoning.
- `deepseek_r1`: starts inside the reasoning whatever the kwargs say.
- `mistral`: starts in the content; `[THINK]` opens the reasoning, `[/THINK]` closes it.
- `openai_gptoss` (alias `gpt_oss`): gpt-oss's harmony channels, read from the reply's token
  ids (pipeline/tokenizer/harmony.py).

Unfinished thinking (no end marker before the reply stops) is all reasoning, no content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.tokenizer.harmony import HarmonyServing

_REASONING, _CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its thinking: marker texts (the first of each tuple the tokenizer
    has as one token is used), where the reply starts and the family's quirks."""

    start: tuple[str, ...]
    end: tuple[str, ...]
    starts_in_reasoning: bool = True
    switch: bool = False  # `enable_thinking: false` turns the split off
    implicit_end: str | None = None  # a marker that ends the reasoning and stays in content
    trim_reasoning_end: bool = False  # whitespace before the end marker dropped
    empty_reasoning: bool = False  # "" (not null) for a reasoning closed with nothing in it
    harmony: bool = False  # gpt-oss's harmony messages, read from token ids (harmony.py)


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat(("<think>",), ("</think>",), switch=True, implicit_end="<tool_call>"),
    "deepseek_r1": ReasoningFormat(("<think>",), ("</think>",), empty_reasoning=True),
    "glm45": ReasoningFormat(("<think>",), ("</think>",), switch=True, trim_reasoning_end=True),
    "mistral": ReasoningFormat(("[THINK]", "<think>"), ("[/THINK]", "</think>"), False),
    "openai_gptoss": ReasoningFormat(("<|channel|>",), ("<|end|>",), harmony=True),
    "gpt_oss": ReasoningFormat(("<|channel|>",), ("<|end|>",), harmony=True),  # an alias
}


@dataclass(frozen=True)
class ReasoningServing:
    """The server's `--reasoning-parser`: the format and its markers (texts and token ids) in
    the served tokenizer (a startup error when the tokenizer lacks them, as in vLLM)."""

    name: str
    format: ReasoningFormat
    start: str
    end: str
    start_id: int
    end_id: int

    @classmethod
    def of(
        cls,
        name: str,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str] | None = None,
    ) -> ReasoningServing | HarmonyServing:
        """The parser `name` over a tokenizer whose `encode` gives a text's token ids (and whose
        `decode` gives token ids' text: gpt-oss's harmony parser reads the ids)."""
        if name not in REASONING_FORMATS:
            raise ValueError(
                f"--reasoning-parser {name!r}: choose from {', '.join(REASONING_FORMATS)}"
            )
        form = REASONING_FORMATS[name]
        if form.harmony:
            return HarmonyServing(name, encode, decode)
        start, end = _single_token(form.start, encode), _single_token(form.end, encode)
        if start is None or end is None:
            raise ValueError(
                f"--reasoning-parser {name}: the tokenizer has no {form.start[0]} / "
                f"{form.end[0]} token"
            )
        return cls(name, form, start, end, encode(start)[0], encode(end)[0])

    def reader(self, template_kwargs: dict[str, Any] | None) -> ReasoningReader:
        """A reader of one reply, for a request whose template saw `template_kwargs`."""
        thinking = (template_kwargs or {}).get("enable_thinking", True) is not False
        return ReasoningReader(self, thinking or not self.format.switch)


def _single_token(candidates: tuple[str, ...], encode: Callable[[str], list[int]]) -> str | None:
    return next((text for text in candidates if len(encode(text)) == 1), None)


class ReasoningReader:
    """One reply split as it comes: `push` each delta's text (its token ids count the reasoning
    tokens), `whole` for an unstreamed reply. Markers are found in the text, as vLLM's parsers
    find them: a special-token marker the detokeniser skips (Mistral's `[THINK]` unless
    `skip_special_tokens: false`) splits nothing, there as in vLLM."""

    def __init__(self, serving: ReasoningServing, active: bool) -> None:
        self.serving, self.form, self.active = serving, serving.format, active
        self.state = _REASONING if self.form.starts_in_reasoning else _CONTENT
        self.pending = ""  # reasoning whitespace held back (trim_reasoning_end)
        self.closed = False  # an end marker was seen
        self.reasoning_tokens = 0  # tokens inside the reasoning, markers left out

    def _markers(self, text: str) -> list[tuple[int, str, str]]:
        """(position, kind, marker text) of each marker in `text`, in order."""
        kinds = [(self.serving.start, "start"), (self.serving.end, "end")]
        if self.form.implicit_end:
            kinds.append((self.form.implicit_end, "implicit"))
        found = []
        for marker, kind in kinds:
            at = text.find(marker)
            while at >= 0:
                found.append((at, kind, marker))
                at = text.find(marker, at + len(marker))
        return sorted(found, key=lambda each: each[0])

    def push(self, text: str, ids: list[int]) -> tuple[str, str]:
        """The reasoning and content texts of one delta."""
        if not self.active:
            return "", text
        self._count(ids)
        reasoning, content, at = [], [], 0
        for position, kind, marker in self._markers(text):
            if position < at:
                continue
            piece = text[at:position]
            if self.state == _REASONING:
                reasoning.append(self._reason(piece))
            else:
                content.append(piece)
            at = position + len(marker)
            if self.state == _REASONING and kind in ("end", "implicit"):
                self.state, self.closed, self.pending = _CONTENT, True, ""
                if kind == "implicit":
                    content.append(marker)  # the tool parser reads it
            elif self.state == _CONTENT and kind == "start" and not self.form.starts_in_reasoning:
                self.state = _REASONING
            elif self.state == _CONTENT and kind != "end":
                content.append(marker)  # a stray start after the thinking is text
        rest = text[at:]
        if self.state == _REASONING:
            reasoning.append(self._reason(rest))
        else:
            content.append(rest)
        return "".join(reasoning), "".join(content)

    def _reason(self, piece: str) -> str:
        """A reasoning piece as sent: GLM's drops the whitespace that ends the reasoning, so
        trailing whitespace waits until more reasoning follows it."""
        if not self.form.trim_reasoning_end:
            return piece
        body = self.pending + piece
        kept = body.rstrip()
        self.pending = body[len(kept) :]
        return kept

    def _count(self, ids: list[int]) -> None:
        markers = (self.serving.start_id, self.serving.end_id)
        for token in ids:
            if token == self.serving.end_id:
                break
            if self.state == _REASONING and token not in markers:
                self.reasoning_tokens += 1

    def finish(self) -> str:
        """The content the reply's end adds (none: the marker formats send all as it comes;
        harmony's reader recovers a cut header here)."""
        return ""

    def whole(self, text: str, ids: list[int]) -> tuple[str | None, str]:
        """(reasoning, content) of an unstreamed reply: null reasoning when there is none."""
        reasoning, content = self.push(text, ids)
        if not self.active:
            return None, content
        if reasoning or (self.closed and self.form.empty_reasoning):
            return reasoning, content
        return None, content
