"""Preference side of `pipe preprocess --preference`: chosen/rejected pairs in, two chat
datasets out.

A line (or row) holds one pair: a prompt, as `"prompt"` (a string: one user message; or a list
of messages) or `"messages"` (a list of messages), and the two replies `"chosen"` and
`"rejected"` (each a string: one assistant message; or a list of messages). Each side is the
prompt followed by its reply, rendered, tokenized and masked exactly as `--chat` does a
conversation (pipeline.preprocess.chat); pair i is document i of the chosen outputs and
document i of the rejected ones. A pair either side of which cannot be used is one bad line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.data.chat_records import BadRecord, check_message, check_text, type_name
from pipeline.preprocess.chat import (
    ChatEncoder,
    EncodedChats,
    ParsedChats,
    conversation,
)
from pipeline.preprocess.encode import BadLine, EncodedBatch, KeyTokens
from pipeline.preprocess.readers import Batch, file_line
from pipeline.tokenizer.engines import POOL

INPUT_KEYS = ("prompt", "messages", "chosen", "rejected")
SIDES = ("chosen", "rejected")
OUTPUT_KEYS = ("chosen", "chosen_loss_mask", "rejected", "rejected_loss_mask")


def pair(record: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The chosen and rejected conversations of one record; raises BadRecord naming the field."""
    if "prompt" in record and "messages" in record:
        raise BadRecord("both 'prompt' and 'messages': give the prompt once")
    if "prompt" in record and isinstance(record["prompt"], str):
        check_text(record["prompt"], "prompt")
        prompt = [{"role": "user", "content": record["prompt"]}]
    elif "prompt" in record or "messages" in record:
        key = "prompt" if "prompt" in record else "messages"
        prompt = _messages(record[key], key)
    else:
        raise BadRecord("no 'prompt' or 'messages' key")
    sides = []
    for side in SIDES:
        if side not in record:
            raise BadRecord(f"no '{side}' key")
        value = record[side]
        if isinstance(value, str):
            check_text(value, side)
            reply = [{"role": "assistant", "content": value}]
        else:
            reply = _messages(value, side)
        try:
            sides.append(conversation({"messages": prompt + reply}))
        except BadRecord as e:
            raise BadRecord(f"{side}: {e}") from None
    return sides[0], sides[1]


def _messages(value: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRecord(f"'{key}' is {type_name(value)}, expected a string or a list of messages")
    return [check_message(m, f"{key}[{i}]") for i, m in enumerate(value)]


class PreferenceEncoder(ChatEncoder):
    """ChatEncoder's three steps for pairs: both sides parsed together, each encoded as a
    chat conversation, and only the pairs whose two sides were both kept packed."""

    def parse(self, batch: Batch) -> tuple[ParsedChats, ParsedChats]:  # type: ignore[override]
        result = EncodedBatch(index=batch.index, keys=[], input_bytes=batch.nbytes)
        result.part = batch.part
        if batch.lines is not None:
            items = (self._parse_line(batch, i, raw, result) for i, raw in enumerate(batch.lines))
        else:
            items = iter(batch.records or [])
        chosen, rejected, offsets = [], [], []
        for offset, record in enumerate(items):
            if record is None:
                continue
            try:
                good, bad = pair(record)
            except BadRecord as e:
                result.bad_lines.append(BadLine(batch.source, file_line(batch, offset), str(e)))
                continue
            chosen.append(good)
            rejected.append(bad)
            offsets.append(offset)
        return (
            ParsedChats(result, batch, chosen, offsets),
            ParsedChats(result, batch, rejected, list(offsets)),
        )

    def encode(self, parsed, threads: str = POOL) -> tuple[EncodedChats, EncodedChats]:  # type: ignore[override]
        sides = []
        for side, half in zip(SIDES, parsed):
            before = len(half.result.bad_lines)
            sides.append(super().encode(half, threads))
            named = [_named(b, side) for b in half.result.bad_lines[before:]]
            half.result.bad_lines[before:] = named
        return sides[0], sides[1]

    def pack(self, parsed, encoded) -> EncodedBatch:  # type: ignore[override]
        result = parsed[0].result
        chosen, rejected = encoded
        kept = np.intersect1d(chosen.offsets, rejected.offsets)
        result.keys = []
        for side in (chosen, rejected):
            side = _select(side, kept)
            ones = np.ones(len(side.lengths), np.int32)
            result.keys.append(
                KeyTokens(side.tokens.astype(self.dtype, copy=False), side.lengths, ones)
            )
            result.keys.append(KeyTokens(side.masks, side.lengths.copy(), ones.copy()))
        result.documents = len(kept)
        first = file_line(parsed[0].batch, 0) if result.documents else 0
        result.lines = kept + first
        seen: set[int] = set()  # one bad line per pair, the first problem found
        unique = []
        for b in sorted(result.bad_lines, key=lambda b: b.line):
            if b.line not in seen or b.fatal:
                seen.add(b.line)
                unique.append(b)
        result.bad_lines = unique
        return result


def _named(bad: BadLine, side: str) -> BadLine:
    if bad.fatal or bad.problem.startswith(f"{side}: "):
        return bad
    return BadLine(bad.source, bad.line, f"{side}: {bad.problem}", bad.fatal)


def _select(side: EncodedChats, kept: np.ndarray) -> EncodedChats:
    """The conversations of `side` whose item offsets are in `kept` (both sorted)."""
    if len(kept) == len(side.offsets):
        return side
    keep = np.isin(side.offsets, kept)
    per_token = np.repeat(keep, side.lengths)
    return EncodedChats(
        side.offsets[keep], side.tokens[per_token], side.masks[per_token], side.lengths[keep]
    )
