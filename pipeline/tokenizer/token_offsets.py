"""Token ids with each token's place in the text it came from (character offsets, as the
`tokenizers` library reports them), for masks over spans of a text (chat templates' assistant
spans).

The fast way: in a byte-level BPE (Llama 3, GPT-2) every token spells a fixed string of bytes,
and the tokens of a text spell its bytes back to back, so the offsets are running sums of
per-token byte lengths, whatever engine produced the ids. That is proven at load, against
`tokenizers`' own offsets on the engine self-test texts, and checked again on every text (the
lengths must add up to its size in bytes). Otherwise, and for any text that fails the check,
`tokenizers` encodes the text with offsets itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.tokenizer.engine_proof import self_test_texts
from pipeline.tokenizer.engines import ALONE, POOL
from pipeline.tokenizer.tokenizer import TextTokenizer, TokenizerError

__all__ = ["OffsetEncoder"]

Encoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # ids, start and end character of each


class OffsetEncoder:
    """Encodes texts as the tokenizer does (no special tokens added) and says where each token
    lies in its text."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        if tokenizer.kind not in ("hf", "gpt2"):
            raise TokenizerError(
                f"{tokenizer.files[0]}: chat data needs a Hugging Face tokenizer.json (or GPT-2 "
                "files): a SentencePiece .model reads a template's special tokens as text"
            )
        self.tokenizer = tokenizer
        self.reference = tokenizer._reference().tokenizer  # a tokenizers.Tokenizer
        self.byte_lengths = _proven_byte_lengths(self.reference)
        self.method = "token bytes" if self.byte_lengths is not None else "tokenizers offsets"

    def encode(self, texts: list[str], threads: str = POOL) -> list[Encoded]:
        """Each text's ids and its tokens' [start, end) characters."""
        if self.byte_lengths is None:
            return self._reference_encode(texts, threads)
        flat, offsets = self.tokenizer.encode_packed(texts, threads)
        out: list[Encoded] = []
        for i, text in enumerate(texts):
            ids = flat[offsets[i] : offsets[i + 1]]
            placed = _from_byte_lengths(text, self.byte_lengths[ids])
            out.append((ids, *placed) if placed else self._reference_encode([text], ALONE)[0])
        return out

    def _reference_encode(self, texts: list[str], threads: str) -> list[Encoded]:
        """`tokenizers`' ids and offsets; one text at a time in a forked copy or beside other
        threads (its thread pool is for the batch call of an unforked process only)."""
        if threads == POOL and len(texts) > 1:
            encodings = self.reference.encode_batch(texts, add_special_tokens=False)
        else:
            encodings = [self.reference.encode(t, add_special_tokens=False) for t in texts]
        return [_arrays(e.ids, e.offsets) for e in encodings]


def _arrays(ids: list[int], offsets: list[tuple[int, int]]) -> Encoded:
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return np.asarray(ids, dtype=np.int64), spans[:, 0], spans[:, 1]


def _from_byte_lengths(text: str, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Character [start, end) of tokens of these byte lengths laid end to end over `text`, as
    `tokenizers` reports them (a token holding part of a character covers that character);
    None when the lengths do not add up to the text's size."""
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    if text.isascii():
        return (starts, ends) if (ends[-1] if len(ends) else 0) == len(text) else None
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if (ends[-1] if len(ends) else 0) != len(raw):
        return None
    char_of_byte = np.cumsum((raw & 0xC0) != 0x80, dtype=np.int64) - 1
    if not len(starts):
        return starts, ends
    return char_of_byte[starts], char_of_byte[np.maximum(ends - 1, starts)] + (ends > starts)


def _proven_byte_lengths(reference: Any) -> np.ndarray | None:
    """Each id's length in bytes, when the tokenizer is byte-level BPE and its offsets follow
    from those lengths on every self-test text; else None."""
    lengths = _byte_lengths(reference)
    if lengths is None:
        return None
    added = [t.content for t in reference.get_added_tokens_decoder().values()]
    for text in self_test_texts(added):
        encoding = reference.encode(text, add_special_tokens=False)
        expected = [tuple(o) for o in encoding.offsets]
        if not encoding.ids:
            continue
        placed = _from_byte_lengths(text, lengths[np.asarray(encoding.ids)])
        if placed is None or list(zip(*(p.tolist() for p in placed))) != expected:
            return None
    return lengths


def _byte_lengths(reference: Any) -> np.ndarray | None:
    """Byte length of every id of a byte-level BPE with no normalizer (vocabulary strings in
    the GPT-2 byte alphabet; added tokens as their text), or None for another kind."""
    if reference.normalizer is not None or "ByteLevel" not in repr(reference.decoder):
        return None
    alphabet = _byte_alphabet()
    added = {i: t.content for i, t in reference.get_added_tokens_decoder().items()}
    vocab = reference.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values(), default=-1) + 1, dtype=np.int64)
    for piece, i in vocab.items():
        if i in added:
            lengths[i] = len(added[i].encode("utf-8"))
        elif all(ch in alphabet for ch in piece):
            lengths[i] = len(piece)  # one alphabet character per byte
        else:
            return None
    return lengths


def _byte_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE spells bytes with: printable Latin-1 bytes stand for
    themselves, the rest are moved up past 255 in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in printable]
    return frozenset(map(chr, printable + [256 + k for k in range(len(moved))]))
