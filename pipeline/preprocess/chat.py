"""Chat side of `pipe preprocess --chat`: conversations in, tokens and a loss mask out.

A line (or row) holds one conversation, in one of three forms:
- OpenAI's `{"messages": [{"role": ..., "content": ...}, ...]}` (other message keys are passed
  to the template as they are);
- ShareGPT's `{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": ...}]}`;
- `{"prompt": ..., "completion": ...}`: two strings (a user and an assistant message), or two
  lists of messages (TRL's conversational form), one after the other.

Each conversation is rendered by the chat template and encoded as a whole, as transformers'
`apply_chat_template(messages, tokenize=True)` does (the text as rendered, no special tokens
added); its loss mask is 1 on the tokens of the assistant's messages (pipeline.tokenizer.
chat_spans says how the template shows where they are). One conversation is one document of
one sequence in both outputs. A conversation that cannot be used is a bad line (file:line); a
template whose spans cannot be derived stops the run whatever --skip-bad-lines says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.chat_records import BadRecord, check_message, check_text, type_name
from pipeline.preprocess.encode import (
    BadLine,
    DocumentEncoder,
    EncodedBatch,
    EncodeOptions,
    KeyTokens,
)
from pipeline.preprocess.readers import Batch, file_line
from pipeline.tokenizer.chat_spans import (
    TemplateRewritesTurns,
    assistant_spans,
    mask_rule,
    token_mask,
)
from pipeline.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    special_tokens,
)
from pipeline.tokenizer.engines import POOL
from pipeline.tokenizer.token_offsets import OffsetEncoder
from pipeline.tokenizer.tokenizer import TextTokenizer

# The columns a tabular input is read for, and the outputs: tokens, then the mask.
INPUT_KEYS = ("messages", "conversations", "prompt", "completion")
TOKENS_KEY = "messages"
MASK_KEY = "messages_loss_mask"
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
}


# ------------------------------------------------------------------------------ the template


@dataclass(frozen=True)
class ChatSetup:
    """The chat template a run renders with, where it came from, and the mask rule it implies."""

    template: ChatTemplate
    origin: str  # the file it was read from
    rule: str  # "generation" | "rendered-prefix" (pipeline.tokenizer.chat_spans)

    def record(self) -> dict[str, str]:
        """What the manifest records: the template's origin and SHA-256, the mask rule."""
        digest = hashlib.sha256(self.template.source().encode("utf-8")).hexdigest()
        return {"template": self.origin, "template_sha256": digest, "mask_rule": self.rule}


def load_chat_setup(tokenizer_path: str | Path, template_file: str | Path | None) -> ChatSetup:
    """The template of `--chat-template FILE`, else the tokenizer's own (chat_template.jinja or
    tokenizer_config.json beside it), with the tokenizer's special tokens; compiled now, so that
    a broken template stops the run before any work. Raises ChatTemplateError."""
    directory = Path(tokenizer_path)
    directory = directory if directory.is_dir() else directory.parent
    if template_file is not None:
        path = Path(template_file)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path}: cannot read the chat template ({e})") from None
        template, origin = ChatTemplate.from_string(source, special_tokens(directory)), str(path)
    else:
        template = load_chat_template(directory)
        if template is None:
            raise ChatTemplateError(
                f"{directory}: the tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); pass --chat-template FILE"
            )
        jinja = directory / "chat_template.jinja"
        origin = str(jinja if jinja.is_file() else directory / "tokenizer_config.json")
    try:
        template.check()
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{origin}: {e}") from None
    return ChatSetup(template, origin, mask_rule(template.source()))


# ------------------------------------------------------------------------------ conversations


def conversation(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of one record, validated; raises BadRecord naming the field at fault."""
    if "messages" in record:
        listed = enumerate(_list(record, "messages"))
        messages = [check_message(m, f"messages[{i}]") for i, m in listed]
    elif "conversations" in record:
        turns = _list(record, "conversations")
        messages = [_sharegpt(t, f"conversations[{i}]") for i, t in enumerate(turns)]
    elif "prompt" in record or "completion" in record:
        messages = _prompt_completion(record)
    else:
        raise BadRecord("no 'messages', 'conversations' or 'prompt'/'completion' key")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant message (nothing to train on)")
    return messages


def _list(record: dict[str, Any], key: str) -> list:
    value = record[key]
    if not isinstance(value, list):
        raise BadRecord(f"'{key}' is {type_name(value)}, expected a list of messages")
    return value


def _sharegpt(turn: Any, where: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRecord(f"{where} is {type_name(turn)}, expected an object")
    speaker = turn.get("from")
    if speaker not in SHAREGPT_ROLES:
        known = ", ".join(SHAREGPT_ROLES)
        raise BadRecord(f"{where}: unknown role {speaker!r} in 'from' (expected {known})")
    check_text(turn.get("value"), f"{where}.value")
    return {"role": SHAREGPT_ROLES[speaker], "content": turn["value"]}


def _prompt_completion(record: dict[str, Any]) -> list[dict[str, Any]]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = [("prompt", i, m) for i, m in enumerate(prompt)]
        turns += [("completion", i, m) for i, m in enumerate(completion)]
        return [check_message(m, f"{key}[{i}]") for key, i, m in turns]
    check_text(prompt, "prompt")
    check_text(completion, "completion")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


# ------------------------------------------------------------------------------ the encoder


@dataclass
class ParsedChats:
    """A batch after parsing: its conversations and each one's item offset in the batch."""

    result: EncodedBatch
    batch: Batch
    conversations: list[list[dict[str, Any]]]
    offsets: list[int]


@dataclass
class EncodedChats:
    """The conversations kept (item offsets in the batch), their tokens and masks back to
    back, and each one's length."""

    offsets: np.ndarray
    tokens: np.ndarray
    masks: np.ndarray
    lengths: np.ndarray


class ChatEncoder(DocumentEncoder):
    """`DocumentEncoder`'s three steps for conversations: `parse` reads and validates them,
    `encode` renders, tokenizes and masks them (the costly part: worker processes run it),
    `pack` lays the kept ones out as documents of the tokens and mask outputs."""

    def __init__(
        self, tokenizer: TextTokenizer, template: ChatTemplate, rule: str, dtype: str
    ) -> None:
        super().__init__(tokenizer, EncodeOptions(INPUT_KEYS, False, dtype))
        self.template = template
        self.rule = rule
        self.offsets = OffsetEncoder(tokenizer)

    def parse(self, batch: Batch) -> ParsedChats:  # type: ignore[override]
        result = EncodedBatch(index=batch.index, keys=[], input_bytes=batch.nbytes)
        result.part = batch.part
        if batch.lines is not None:
            items = (self._parse_line(batch, i, raw, result) for i, raw in enumerate(batch.lines))
        else:
            items = iter(batch.records or [])
        conversations, offsets = [], []
        for offset, record in enumerate(items):
            if record is None:
                continue
            try:
                conversations.append(conversation(record))
            except BadRecord as e:
                result.bad_lines.append(BadLine(batch.source, file_line(batch, offset), str(e)))
                continue
            offsets.append(offset)
        return ParsedChats(result, batch, conversations, offsets)

    def encode(self, parsed: ParsedChats, threads: str = POOL) -> EncodedChats:  # type: ignore[override]
        texts, spans, offsets = [], [], []
        for offset, messages in zip(parsed.offsets, parsed.conversations):
            try:
                rendered = assistant_spans(self.template, messages, self.rule)
            except ChatTemplateError as e:
                fatal = isinstance(e, TemplateRewritesTurns)
                self._bad(parsed, offset, str(e) if fatal else f"chat template: {e}", fatal)
                continue
            texts.append(rendered.text)
            spans.append(rendered.spans)
            offsets.append(offset)
        placed = self.offsets.encode(texts, threads)
        shifted = []  # every span, on the scale of placed.starts/ends
        for k, text_spans in enumerate(spans):
            ends = placed.position(k, [c for span in text_spans for c in span])
            shifted += zip(ends[::2], ends[1::2])
        mask = token_mask(placed.starts, placed.ends, shifted)
        lengths = np.diff(placed.offsets)
        running = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        ones = running[placed.offsets[1:]] - running[placed.offsets[:-1]]
        useless = (ones == 0) | (ones == lengths)
        for k in np.flatnonzero(useless):
            what = "no token" if ones[k] == 0 else "every token"
            self._bad(parsed, offsets[k], f"the loss mask covers {what} of the conversation")
        kept = np.asarray(offsets, dtype=np.int64)
        if useless.any():
            keep = ~useless
            per_token = np.repeat(keep, lengths)
            kept, lengths = kept[keep], lengths[keep]
            placed.ids, mask = placed.ids[per_token], mask[per_token]
        return EncodedChats(kept, placed.ids, mask, lengths.astype(np.int32))

    def pack(self, parsed: ParsedChats, encoded: EncodedChats) -> EncodedBatch:  # type: ignore[override]
        result = parsed.result
        ones = np.ones(len(encoded.lengths), np.int32)
        result.keys = [
            KeyTokens(encoded.tokens.astype(self.dtype, copy=False), encoded.lengths, ones),
            KeyTokens(encoded.masks, encoded.lengths.copy(), ones.copy()),
        ]
        result.documents = len(encoded.lengths)
        first = file_line(parsed.batch, 0) if result.documents else 0
        result.lines = encoded.offsets + first
        result.bad_lines.sort(key=lambda b: b.line)
        return result

    def _bad(self, parsed: ParsedChats, offset: int, problem: str, fatal: bool = False) -> None:
        line = file_line(parsed.batch, offset)
        parsed.result.bad_lines.append(BadLine(parsed.batch.source, line, problem, fatal))
