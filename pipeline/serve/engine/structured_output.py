"""Structured output: a request's text held to a JSON schema, a regular expression, a list of
choices or a grammar, by masking the tokens that cannot continue it (vLLM's structured outputs).

The grammar engine is llguidance (the `structured` extra), chosen by measurement on a CPU
(docs/benchmarks.md, "Structured output: the grammar engine"): it builds each grammar lazily,
so a new schema costs under a millisecond where xgrammar compiles for a third of a second on
Llama 3's vocabulary, and its mask over 128k tokens costs a fraction of xgrammar's and
outlines-core's per token.

A request asks through `SamplingParams.structured_output` (a `StructuredOutput`: what kind of
constraint and its text, small and picklable, so it crosses to the engine process as it is). The
engine calls `GrammarBackend.constrain` once a step, after the model's forward and before
sampling: each asking row gets a matcher (`Request.guide`), which first consumes the tokens the
row produced since the last step, then writes the row's bitmask; the rows are masked in one go.
Rows that do not ask are never touched. A finished grammar allows only the stop tokens, so the
request ends with "stop" at its next token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# compact JSON as OpenAI's models write it; no free whitespace, so a weak model cannot spin on it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A constraint that cannot be built (the message says why); a 400 at the API naming
    `param`, the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def import_llguidance():
    """llguidance, or a one-line error naming the extra that installs it."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError(
            "structured output needs llguidance: pip install 'pipe-llm[structured]'"
        ) from None
    return llguidance


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint: `kind` (one of `KINDS`) and its text: a JSON schema as JSON, a
    regular expression, a JSON list of choices, or a Lark (or GBNF) grammar."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output {self.kind!r}; one of {KINDS}")

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutput:
        """Output that is a JSON value valid under `schema` (what `tool_choice` required or
        named uses to force a call's arguments)."""
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema is an object, not {type(schema).__name__}")
        return cls("json", json.dumps(schema, sort_keys=True))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        """Output that is exactly one of `choices`."""
        if not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredOutputError("choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)))

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (cached by its text)."""
        return _grammar(self.kind, self.spec)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec: str) -> str:
    llguidance = import_llguidance()
    matcher = llguidance.LLMatcher
    if kind == "json":
        grammar = matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    elif kind == "json_object":
        grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(spec)
    elif kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
        grammar = matcher.grammar_from_lark(f"start: {alternatives}")
    else:
        grammar = matcher.grammar_from_lark(_lark(spec))
    error = matcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(error.strip().splitlines()[0])
    return grammar


def _lark(spec: str) -> str:
    """A grammar in Lark, as llguidance reads it: GBNF (`::=` rules, xgrammar's and llama.cpp's
    format, as vLLM users write it) converted."""
    if "::=" not in spec:
        return spec
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(spec)
    except Exception as error:  # noqa: BLE001 - the converter's own error, reported as such
        raise StructuredOutputError(f"GBNF grammar: {error}") from None


class RowGuide:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher) -> None:
        self.matcher, self.consumed = matcher, 0

    def catch_up(self, output: list[int]) -> None:
        """Consume the tokens the row produced since the last step (one, in the usual case)."""
        for token in output[self.consumed :]:
            if not self.matcher.is_stopped():  # past the end: the stop tokens of ignore_eos
                self.matcher.consume_token(token)
        self.consumed = len(output)


class GrammarBackend:
    """Grammars over one tokenizer (`tokenizer_json`: its tokenizer.json text) for a model of
    `vocab_size` logits, ending at `eos_ids`. The tokenizer is prepared at the first request
    that asks (about a second for a 128k vocabulary), so a server that never constrains pays
    nothing."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        # checked once: a request's n choices, and the requests that repeat a schema
        self._checked: set[StructuredOutput] = set()

    @classmethod
    def from_path(
        cls, tokenizer: str | Path, vocab_size: int, eos_ids: Sequence[int]
    ) -> GrammarBackend | None:
        """The backend for a tokenizer.json or a directory holding one, else None (structured
        output is then refused)."""
        path = Path(tokenizer)
        path = path if path.is_file() else path / "tokenizer.json"
        return (
            cls(path.read_text(), vocab_size, eos_ids)
            if path.name == "tokenizer.json" and path.is_file()
            else None
        )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llguidance = import_llguidance()
            self._tokenizer = llguidance.LLTokenizer(
                self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
            )
        return self._tokenizer

    def check(self, output: StructuredOutput) -> None:
        """`StructuredOutputError` if `output` cannot be built for this tokenizer."""
        if output in self._checked:
            return
        error = import_llguidance().LLMatcher.validate_grammar(output.grammar(), self.tokenizer)
        if error:
            raise StructuredOutputError(error.strip().splitlines()[0])
        if len(self._checked) > 1024:
            self._checked.clear()
        self._checked.add(output)

    def guide(self, row) -> RowGuide:
        """The row's matcher, made at its first constrained step."""
        if row.guide is None:
            matcher = import_llguidance().LLMatcher(
                self.tokenizer, row.params.structured_output.grammar(), log_level=0
            )
            row.guide = RowGuide(matcher)
        return row.guide

    def constrain(self, logits: torch.Tensor, rows: Sequence[Any]) -> None:
        """Mask `logits` `[rows, vocab]` (in place) to the tokens each asking row's grammar
        allows next; rows without `params.structured_output` are left as they are."""
        asking = [i for i, row in enumerate(rows) if row.params.structured_output is not None]
        if not asking:
            return
        # llguidance writes each row's bits straight into the tensor (its torch helpers would
        # import torch._dynamo, seconds at the first request, for the same two calls)
        bitmask = torch.zeros(len(asking), -(-self.vocab_size // 32), dtype=torch.int32)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        for slot, index in enumerate(asking):
            guide = self.guide(rows[index])
            guide.catch_up(rows[index].output)
            guide.matcher.unsafe_compute_mask_ptr(bitmask[slot].data_ptr(), row_bytes)
            if not bitmask[slot].any():  # a stopped or failed matcher: end the row
                self._allow_stop(bitmask[slot], rows[index].params.stop_token_ids)
        logits[asking] = masked(logits[asking], bitmask.to(logits.device))

    def _allow_stop(self, words: torch.Tensor, stop_token_ids) -> None:
        for token in stop_token_ids or self.eos_ids:
            bit = token % 32
            words[token // 32] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` `[rows, vocab]` with -inf where `bitmask` `[rows, ceil(vocab / 32)]` (int32,
    bit j of word w: token 32 w + j) has a 0."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    allowed = allowed.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]].bool()
    return logits.masked_fill(~allowed, -torch.inf)
