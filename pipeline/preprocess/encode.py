"""Worker side of `pipe preprocess`: parse a batch of input items, validate them, tokenize, and
pack the result as flat arrays ready to append to the `.bin`/`.idx` writers.

Encoding follows Megatron's `tools/preprocess_data.py` document level: per key, a string value is
one sentence and a list of strings is several (Megatron's sentence-split files); sentences with no
token are dropped; `append_eod` adds the end-of-document id to the last sentence of every document
that has a token. A document with no token stays a document with no sequence.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from pipeline.preprocess.readers import Batch, file_line
from pipeline.preprocess.tokenizer import TextTokenizer

_UTF8_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class BadLine:
    """One input item that could not be used, with where it is and what is wrong."""

    source: str
    line: int
    problem: str

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
    """What a worker sends back for one `Batch`."""

    index: int
    keys: list[KeyTokens]
    documents: int = 0
    blank_lines: int = 0
    text_bytes: int = 0
    input_bytes: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)


@dataclass(frozen=True)
class EncodeOptions:
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str  # numpy dtype name of the output tokens


class DocumentEncoder:
    """Turns `Batch`es into `EncodedBatch`es; one per worker process."""

    def __init__(self, tokenizer: TextTokenizer, options: EncodeOptions):
        if options.append_eod and tokenizer.eod is None:
            raise ValueError("--append-eod: the tokenizer has no end-of-document (EOS) token")
        self.tokenizer = tokenizer
        self.options = options
        self.dtype = np.dtype(options.dtype)

    def __call__(self, batch: Batch) -> EncodedBatch:
        result = EncodedBatch(index=batch.index, keys=[], input_bytes=batch.nbytes)
        documents = self._parse(batch, result)  # per document: one list of sentences per key
        result.documents = len(documents)
        for k in range(len(self.options.keys)):
            result.keys.append(self._encode_key([doc[k] for doc in documents]))
        return result

    # ----------------------------------------------------------------------------- parsing

    def _parse(self, batch: Batch, result: EncodedBatch) -> list[list[list[str]]]:
        documents = []
        if batch.lines is not None:
            items = (self._parse_line(batch, i, raw, result) for i, raw in enumerate(batch.lines))
        else:
            items = (r for r in batch.records or [])
        for offset, record in enumerate(items):
            if record is None:
                continue
            try:
                documents.append([self._sentences(record, key) for key in self.options.keys])
            except _Bad as e:
                result.bad_lines.append(BadLine(batch.source, file_line(batch, offset), str(e)))
        return documents

    def _parse_line(self, batch: Batch, i: int, raw: bytes, result: EncodedBatch) -> dict | None:
        """One JSONL line as a dict; None for a blank or bad line (a bad one is recorded)."""
        result.text_bytes += len(raw) + 1
        if not raw.strip():
            result.blank_lines += 1
            return None
        at_file_start = batch.start_byte == 0 and batch.first_line + i == 1
        if at_file_start and raw.startswith(_UTF8_BOM):
            raw = raw[len(_UTF8_BOM) :]
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 at byte {e.start} of the line"
        except json.JSONDecodeError as e:
            problem = f"malformed JSON: {e.msg} at column {e.colno}"
        else:
            if isinstance(record, dict):
                return record
            problem = f"expected a JSON object, got {_type_name(record)}"
        result.bad_lines.append(BadLine(batch.source, file_line(batch, i), problem))
        return None

    def _sentences(self, record: dict, key: str) -> list[str]:
        if key not in record:
            raise _Bad(f"missing key '{key}'")
        value = record[key]
        sentences = [value] if isinstance(value, str) else value
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise _Bad(f"key '{key}' is {_type_name(value)}, expected a string")
        for s in sentences:
            if not s.isascii() and _SURROGATE.search(s):
                raise _Bad(f"key '{key}' holds an unpaired surrogate (not valid Unicode)")
        return sentences

    # ----------------------------------------------------------------------------- encoding

    def _encode_key(self, documents: list[list[str]]) -> KeyTokens:
        flat = [s for sentences in documents for s in sentences]
        ids = self.tokenizer.encode_batch(flat) if flat else []
        eod = [self.tokenizer.eod] if self.options.append_eod else None
        pieces: list[list[int]] = []
        lengths: list[int] = []
        per_document: list[int] = []
        position = 0
        for sentences in documents:
            kept = [x for x in ids[position : position + len(sentences)] if x]
            position += len(sentences)
            pieces.extend(kept)
            lengths.extend(len(x) for x in kept)
            if kept and eod:
                pieces.append(eod)
                lengths[-1] += 1
            per_document.append(len(kept))
        total = sum(lengths)
        tokens = np.fromiter(chain.from_iterable(pieces), dtype=self.dtype, count=total)
        return KeyTokens(
            tokens, np.asarray(lengths, dtype=np.int32), np.asarray(per_document, dtype=np.int32)
        )


class _Bad(ValueError):
    """A record-level problem, reported with the record's file and line."""


def _type_name(value: object) -> str:
    names = {dict: "an object", list: "a list", int: "a number", float: "a number"}
    names[bool] = "a boolean"
    return "null" if value is None else names.get(type(value), type(value).__name__)
