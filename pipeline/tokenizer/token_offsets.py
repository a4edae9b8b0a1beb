"""Token ids with each token's place in the text it came from (character offsets, as the
`tokenizers` library reports them), for masks over spans of a text (chat templates' assistant
spans).

The fast way: in a byte-level BPE (Llama 3, GPT-2) every token spells a fixed string of bytes,
and the tokens of a text spell its bytes back to back, so the offsets are running sums of
per-token byte lengths, whatever engine produced the ids. That is proven at load, against
`tokenizers`' own offsets on the engine self-test texts, and checked again on every batch (each
text's lengths must add up to its size in bytes). Otherwise, and for a batch that fails the
check, `tokenizers` encodes the texts with offsets itself. A batch is placed as a whole, with
numpy: per-text work in Python would cost more than the encoding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.common.atomic import atomic_file
from pipeline.tokenizer.engine_proof import _proof_file, self_test_texts
from pipeline.tokenizer.engines import POOL
from pipeline.tokenizer.tokenizer import TextTokenizer, TokenizerError, _proof_key

_VERSION = "1"  # bump when the byte-length proof changes: cached tables are then not reused

__all__ = ["OffsetEncoder", "Placed"]


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
        self.byte_lengths = _cached_byte_lengths(tokenizer)
        self.method = "token bytes" if self.byte_lengths is not None else "tokenizers offsets"

    @property
    def reference(self) -> Any:
        """The `tokenizers.Tokenizer` (loaded when first needed)."""
        return self.tokenizer._reference().tokenizer

    def encode(self, texts: list[str], threads: str = POOL) -> Placed:
        """All texts' ids back to back, each text's offsets into them (len(texts) + 1), and
        where each token lies in the texts laid end to end (see `Placed`)."""
        if self.byte_lengths is not None:
            flat, offsets = self.tokenizer.encode_packed(texts, threads)
            placed = _from_byte_lengths(texts, flat, offsets, self.byte_lengths[flat])
            if placed is not None:
                return placed
        return self._reference_encode(texts, threads)

    def _reference_encode(self, texts: list[str], threads: str) -> Placed:
        """`tokenizers`' ids and offsets; one text at a time in a forked copy or beside other
        threads (its thread pool is for the batch call of an unforked process only)."""
        if threads == POOL and len(texts) > 1:
            encodings = self.reference.encode_batch(texts, add_special_tokens=False)
        else:
            encodings = [self.reference.encode(t, add_special_tokens=False) for t in texts]
        counts = [len(e.ids) for e in encodings]
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = np.fromiter((i for e in encodings for i in e.ids), np.int64, int(offsets[-1]))
        spans = np.fromiter(
            (c for e in encodings for o in e.offsets for c in o), np.int64, 2 * int(offsets[-1])
        ).reshape(-1, 2)
        bases = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in texts], out=bases[1:])
        shift = np.repeat(bases[:-1], counts)
        return Placed(flat, offsets, spans[:, 0] + shift, spans[:, 1] + shift, bases, {})


@dataclass
class Placed:
    """Encoded texts: flat ids, per-text offsets into them, and each token's [start, end) in
    the texts laid end to end, counted in characters or, for the texts in `wide`, in UTF-8
    bytes (`bases`: where each text starts). `position` maps characters of a text to the same
    scale; either way a token overlaps a character span exactly when `tokenizers`' character
    offsets say so (a token holding part of a character covers all of it)."""

    ids: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    bases: np.ndarray
    wide: dict[int, str]  # texts counted in bytes whose characters are not all one byte

    def position(self, text: int, chars: list[int]) -> list[int]:
        """Where the given (ascending) character positions of text `text` lie on the scale of
        `starts` and `ends`."""
        base = int(self.bases[text])
        if text not in self.wide:
            return [base + c for c in chars]
        source, out, done, at = self.wide[text], [], 0, base
        for c in chars:
            at += len(source[done:c].encode("utf-8"))
            done = c
            out.append(at)
        return out


def _from_byte_lengths(
    texts: list[str], flat: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> Placed | None:
    """The tokens laid end to end by their byte lengths (in UTF-8 bytes: each text's tokens
    must spell exactly its bytes, else None)."""
    if len(lengths) and lengths.min() < 1:
        return None
    ends = np.cumsum(lengths, dtype=np.int64)
    sizes = np.fromiter((len(t) for t in texts), np.int64, len(texts))
    wide = {k: t for k, t in enumerate(texts) if not t.isascii()}
    for k, text in wide.items():
        sizes[k] = len(text.encode("utf-8"))
    bases = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bases[1:])
    if not np.array_equal(np.concatenate([[0], ends])[offsets], bases):
        return None
    return Placed(flat, offsets, ends - lengths, ends, bases, wide)


def _cached_byte_lengths(tokenizer: TextTokenizer) -> np.ndarray | None:
    """`_proven_byte_lengths`, remembered beside the engine proofs (keyed by the tokenizer
    files' SHA-256 and the library installs), so that a later run loads neither `tokenizers`
    nor the vocabulary. The cache holds a plain .npy array (read without pickle)."""
    cache = _proof_file(f"token-bytes-{_VERSION}\0{_proof_key(tokenizer)}")
    if cache is not None and cache.is_file():
        with contextlib.suppress(OSError, ValueError):
            return np.load(cache, allow_pickle=False)
    lengths = _proven_byte_lengths(tokenizer._reference().tokenizer)
    if lengths is not None and cache is not None:
        with contextlib.suppress(OSError), atomic_file(cache) as f:
            np.save(f, lengths, allow_pickle=False)
    return lengths


def _proven_byte_lengths(reference: Any) -> np.ndarray | None:
    """Each id's length in bytes, when the tokenizer is byte-level BPE and its offsets follow
    from those lengths on every self-test text; else None."""
    lengths = _byte_lengths(reference)
    if lengths is None:
        return None
    added = [t.content for t in reference.get_added_tokens_decoder().values()]
    texts = self_test_texts(added)
    encodings = [reference.encode(t, add_special_tokens=False) for t in texts]
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(e.ids) for e in encodings], out=offsets[1:])
    flat = np.asarray([i for e in encodings for i in e.ids], dtype=np.int64)
    placed = _from_byte_lengths(texts, flat, offsets, lengths[flat])
    if placed is None:
        return None
    for k, (text, encoding) in enumerate(zip(texts, encodings)):
        lo, hi = offsets[k], offsets[k + 1]
        base = placed.bases[k]
        # The character holding each byte: tokens' byte spans rounded out to characters.
        char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
        starts = char_of_byte[placed.starts[lo:hi] - base]
        ends = char_of_byte[placed.ends[lo:hi] - base - 1] + 1
        if list(zip(starts.tolist(), ends.tolist())) != [tuple(o) for o in encoding.offsets]:
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
