"""Encoding side of `pipe preprocess`: parse a batch of input items, validate them, tokenize, and
pack the result as flat arrays ready to append to the `.bin`/`.idx` writers.

Encoding follows Megatron's `tools/preprocess_data.py` document level: per key, a string value is
one sentence and a list of strings is several (Megatron's sentence-split files); sentences with no
token are dropped; `append_eod` adds the end-of-document id to the last sentence of every document
that has a token. A document with no token stays a document with no sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import orjson

from pipeline.data.chat_records import SURROGATE, BadRecord, type_name
from pipeline.preprocess.readers import Batch, file_line
from pipeline.tokenizer.engines import POOL
from pipeline.tokenizer.tokenizer import TextTokenizer

_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class BadLine:
    """One input item that could not be used, with where it is and what is wrong."""

    source: str
    line: int
    problem: str
    fatal: bool = False  # stops the run even with --skip-bad-lines (a template that cannot work)

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.problem}"


@dataclass
class KeyTokens:
    """Tokens of one JSON key for a batch: flat ids, each sequence's length, and each document's
    number of sequences (0 for an empty document)."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass
class EncodedBatch:
    """What the encoder gives back for one `Batch`: tokens per key, counts, bad lines, and each
    document's line (or row) number in its file."""

    index: int
    keys: list[KeyTokens]
    documents: int = 0
    blank_lines: int = 0
    text_bytes: int = 0
    input_bytes: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)
    part: int = 0  # which input part the batch came from
    lines: np.ndarray | None = None  # int64 per document


@dataclass(frozen=True)
class EncodeOptions:
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str  # numpy dtype name of the output tokens


@dataclass
class ParsedBatch:
    """A batch after parsing: per key, every sentence of every document in one flat list, and
    how many sentences each document has (None: exactly one each, the common case)."""

    result: EncodedBatch
    texts: list[list[str]]
    sentence_counts: list[list[int] | None]


class DocumentEncoder:
    """Turns `Batch`es into `EncodedBatch`es in three steps, so that the runner can overlap
    them: `parse` (Python), `encode` (the engine, without the GIL), `pack` (numpy)."""

    def __init__(self, tokenizer: TextTokenizer, options: EncodeOptions):
        if options.append_eod and tokenizer.eod is None:
            raise ValueError("--append-eod: the tokenizer has no end-of-document (EOS) token")
        self.tokenizer = tokenizer
        self.options = options
        self.dtype = np.dtype(options.dtype)
        self.eod = tokenizer.eod if options.append_eod else None

    def __call__(self, batch: Batch, threads: str = POOL) -> EncodedBatch:
        parsed = self.parse(batch)
        return self.pack(parsed, self.encode(parsed, threads))

    # ----------------------------------------------------------------------------- parsing

    def parse(self, batch: Batch) -> ParsedBatch:
        """Validate every item and collect its sentences; bad items are recorded, not raised."""
        result = EncodedBatch(index=batch.index, keys=[], input_bytes=batch.nbytes)
        result.part = batch.part
        keys = self.options.keys
        texts: list[list[str]] = [[] for _ in keys]
        counts: list[list[int]] = [[] for _ in keys]
        single = [True] * len(keys)
        offsets: list[int] = []
        if batch.lines is not None:
            items = (self._parse_line(batch, i, raw, result) for i, raw in enumerate(batch.lines))
        else:
            items = iter(batch.records or [])
        for offset, record in enumerate(items):
            if record is None:
                continue
            try:
                values = [self._sentences(record, key) for key in keys]
            except BadRecord as e:
                result.bad_lines.append(BadLine(batch.source, file_line(batch, offset), str(e)))
                continue
            offsets.append(offset)
            for k, value in enumerate(values):
                if isinstance(value, str):
                    texts[k].append(value)
                    counts[k].append(1)
                else:
                    texts[k].extend(value)
                    counts[k].append(len(value))
                    single[k] = False
        result.documents = len(offsets)
        first = file_line(batch, 0) if offsets else 0
        result.lines = np.asarray(offsets, dtype=np.int64) + first
        return ParsedBatch(result, texts, [None if s else c for s, c in zip(single, counts)])

    def _parse_line(self, batch: Batch, i: int, raw: bytes, result: EncodedBatch) -> dict | None:
        """One JSONL line as a dict; None for a blank or bad line (a bad one is recorded)."""
        result.text_bytes += len(raw) + 1
        if not raw or raw.isspace():
            result.blank_lines += 1
            return None
        try:
            record = orjson.loads(raw)  # strict: valid UTF-8, no lone surrogates, no NaN
        except orjson.JSONDecodeError:
            return self._parse_line_strictly(batch, i, raw, result)
        if isinstance(record, dict):
            return record
        return self._parse_line_strictly(batch, i, raw, result)  # names what it is instead

    def _parse_line_strictly(
        self, batch: Batch, i: int, raw: bytes, result: EncodedBatch
    ) -> dict | None:
        """The standard library's verdict on a line orjson refused: it accepts a little more
        (NaN, a BOM at the file start, lone surrogates, which are then refused here) and its
        messages name the problem."""
        if raw.startswith(_UTF8_BOM) and batch.start_byte == 0 and batch.first_line + i == 1:
            raw = raw[len(_UTF8_BOM) :]
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 at byte {e.start} of the line"
        except json.JSONDecodeError as e:
            problem = f"malformed JSON: {e.msg} at column {e.colno}"
        except RecursionError:
            problem = "malformed JSON: nested too deeply"
        else:
            if not isinstance(record, dict):
                problem = f"expected a JSON object, got {type_name(record)}"
            elif surrogate := _surrogate_key(record, self.options.keys):
                problem = f"key '{surrogate}' holds an unpaired surrogate (not valid Unicode)"
            else:
                return record
        result.bad_lines.append(BadLine(batch.source, file_line(batch, i), problem))
        return None

    def _sentences(self, record: dict, key: str) -> str | list[str]:
        """The key's value: one string, or a list of strings (sentences)."""
        if key not in record:
            raise BadRecord(f"missing key '{key}'")
        value = record[key]
        sentences = [value] if isinstance(value, str) else value
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise BadRecord(f"key '{key}' is {type_name(value)}, expected a string")
        return value

    # ----------------------------------------------------------------------------- encoding

    def encode(
        self, parsed: ParsedBatch, threads: str = POOL
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Flat ids and offsets per key (the engine releases the GIL while it works; see
        TextTokenizer.encode_packed for `threads`)."""
        empty = (np.empty(0, np.int64), np.zeros(1, np.int64))
        return [self.tokenizer.encode_packed(t, threads) if t else empty for t in parsed.texts]

    def pack(
        self, parsed: ParsedBatch, encoded: list[tuple[np.ndarray, np.ndarray]]
    ) -> EncodedBatch:
        """Megatron's document layout per key: empty sentences dropped, EOD appended to the last
        sentence of every document that has a token."""
        result = parsed.result
        for (flat, offsets), counts in zip(encoded, parsed.sentence_counts):
            result.keys.append(pack_documents(flat, offsets, counts, self.eod, self.dtype))
        return result


def pack_documents(
    flat: np.ndarray,
    offsets: np.ndarray,
    sentence_counts: list[int] | None,
    eod: int | None,
    dtype: np.dtype,
) -> KeyTokens:
    """Turn encoded sentences (flat ids, offsets) into documents' sequences, vectorized."""
    lengths = np.diff(offsets)
    keep = lengths > 0
    sequence_lengths = lengths[keep].astype(np.int32)
    if sentence_counts is None:  # one sentence per document
        per_document = keep.astype(np.int32)
        document_ends = np.arange(1, len(lengths) + 1)
    else:
        counts = np.asarray(sentence_counts, dtype=np.int64)
        owner = np.repeat(np.arange(len(counts)), counts)
        per_document = np.bincount(owner[keep], minlength=len(counts)).astype(np.int32)
        document_ends = np.cumsum(counts)
    tokens = flat
    if eod is not None and len(sequence_lengths):
        nonempty = per_document > 0
        tokens = np.insert(flat, offsets[document_ends[nonempty]], eod)
        sequence_lengths[np.cumsum(per_document)[nonempty] - 1] += 1
    return KeyTokens(tokens.astype(dtype, copy=False), sequence_lengths, per_document)


def _surrogate_key(record: dict, keys: tuple[str, ...]) -> str | None:
    """The first key whose text holds an unpaired surrogate (only the standard library's parser
    lets one through; orjson and Arrow refuse them)."""
    for key in keys:
        value = record.get(key)
        for s in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            if isinstance(s, str) and not s.isascii() and SURROGATE.search(s):
                return key
    return None
