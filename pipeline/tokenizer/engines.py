"""Encoding engines behind `TextTokenizer`: gigatoken (fast), and the reference libraries
(`tokenizers`, `sentencepiece`) it must agree with.

Every engine has the same small interface: `name`, `vocab_size`, `encode_packed(texts, threads)`
giving all ids back to back plus offsets (no Python list per document on the fast path),
`encode(text)` for one text, and `decode(ids)`. Engines release the GIL while encoding a batch, so
the runner overlaps encoding with reading and parsing. `threads` says where a batch may run
(POOL, SHARED, ALONE below); engines with `serial_batches` honour SHARED and ALONE, others always
use their own pool. `forks` says whether ALONE is safe in a forked copy of the process.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

# Where a batch may be encoded (`encode_packed`'s `threads`):
POOL = "pool"  # spread over the engine's own thread pool
SHARED = "shared"  # on the calling thread; other threads may be encoding beside it
ALONE = "alone"  # on the calling thread, the only one encoding in this process

# Batches no larger than this are encoded without gigatoken's batch call (see GigatokenEngine).
_SMALL_BATCH_TEXTS = 64
_SMALL_BATCH_CHARS = 1 << 16


class EngineUnavailable(RuntimeError):
    """gigatoken cannot represent this tokenizer (not installed, or an unsupported form)."""


class TokenizersEngine:
    """The Hugging Face `tokenizers` reference (also the fallback engine)."""

    name = "tokenizers"
    serial_batches = False  # a batch always runs on tokenizers' own thread pool
    forks = False  # its pool, once used, turns itself off in a forked copy, with a warning

    def __init__(self, tokenizer: Any, add_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_packed(self, texts: list[str], threads: str = POOL) -> tuple[np.ndarray, np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.21) skips offset tracking: same ids, ~20% faster.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        ids = [e.ids for e in encode(texts, add_special_tokens=self.add_special_tokens)]
        return _pack(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def added_tokens(self) -> list[str]:
        """Contents of the added (special or not) tokens, matched whole inside text."""
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]


class SentencePieceEngine:
    """The `sentencepiece` reference for `.model` files (Megatron's SentencePieceTokenizer)."""

    name = "sentencepiece"
    serial_batches = False
    forks = False

    def __init__(self, processor: Any, prefix: list[int]) -> None:
        self.processor = processor
        self.prefix = prefix  # [BOS] with add_special_tokens
        self.vocab_size = processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.prefix + self.processor.encode(text)

    def encode_packed(self, texts: list[str], threads: str = POOL) -> tuple[np.ndarray, np.ndarray]:
        return _pack([self.prefix + x for x in self.processor.encode(texts)])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """sentencepiece never writes control pieces (BOS, EOS): either way the same text."""
        return self.processor.decode(ids)

    def added_tokens(self) -> list[str]:
        """Pieces that are not ordinary text: control, unknown, user-defined and byte pieces."""
        p = self.processor
        kinds = (p.is_control, p.is_unknown, p.is_unused, p.is_byte)
        return [p.id_to_piece(i) for i in range(self.vocab_size) if any(k(i) for k in kinds)]


class GigatokenEngine:
    """gigatoken's Rust BPE, plus the fixed ids a post-processor adds around each text.

    POOL and SHARED go through gigatoken's batch call, on its thread pool or on the calling
    thread (so that several threads can encode a batch each with no pool barrier between
    batches). The batch call builds its result as an awkward Array, whose import costs about
    0.25 s on first use, so ALONE, and a small batch under POOL (a tiny input), make one call
    per text instead: as fast serially on documents of a few kilobytes, and no import.
    One-text calls are refused while another thread is inside a batch call ("Already
    borrowed"): hence never under SHARED.
    ALONE never touches the thread pool, so it also runs in a forked copy of the process.
    """

    name = "gigatoken"
    serial_batches = True
    forks = True

    def __init__(self, tokenizer: Any, prefix: list[int], suffix: list[int]) -> None:
        self.tokenizer = tokenizer
        self.prefix, self.suffix = prefix, suffix
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.prefix + self.tokenizer.encode(text).tolist() + self.suffix

    def encode_packed(self, texts: list[str], threads: str = POOL) -> tuple[np.ndarray, np.ndarray]:
        small = len(texts) <= _SMALL_BATCH_TEXTS and sum(map(len, texts)) <= _SMALL_BATCH_CHARS
        if threads == ALONE or (threads == POOL and small):
            flat, offsets = self._encode_each(texts)
        else:
            flat, offsets = self._encode_batch(texts, parallel=threads == POOL)
        if self.prefix or self.suffix:
            return _add_affixes(flat, offsets, self.prefix, self.suffix)
        return flat, offsets

    def _encode_each(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        arrays = [self.tokenizer.encode(t) for t in texts]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.empty(0, np.uint32)
        return flat, offsets

    def _encode_batch(self, texts: list[str], parallel: bool) -> tuple[np.ndarray, np.ndarray]:
        layout = self.tokenizer.encode_batch(_utf8_array(texts), parallel=parallel).layout
        flat = np.asarray(layout.content.data)
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        return flat[offsets[0] : offsets[-1]], offsets - offsets[0]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(np.asarray(ids, dtype=np.uint32)).decode("utf-8", "replace")


def _utf8_array(texts: list[str]) -> Any:
    """`texts` as one awkward string array: a single UTF-8 buffer plus offsets.

    Handed a list of `str`, gigatoken takes the GIL back for every text it reads, so an encoding
    thread stalls whenever the main thread is parsing (measured: a third more CPU and half its
    time waiting); handed this array, it reads the buffer with the GIL released throughout.
    awkward is gigatoken's own dependency, imported by its first batch call anyway.
    """
    import awkward as ak

    encoded = [t.encode("utf-8") for t in texts]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    content = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    chars = ak.contents.NumpyArray(content, parameters={"__array__": "char"})
    strings = ak.contents.ListOffsetArray(
        ak.index.Index64(offsets), chars, parameters={"__array__": "string"}
    )
    return ak.Array(strings)


def gigatoken_from_json(text: str, post_processor: dict | None) -> GigatokenEngine:
    """gigatoken for a tokenizer.json; `post_processor` (given with add_special_tokens) adds
    its fixed prefix/suffix ids."""
    gigatoken = _import_gigatoken()
    prefix, suffix = post_processor_affixes(post_processor)
    try:
        return GigatokenEngine(gigatoken.Tokenizer.from_json(text), prefix, suffix)
    except (ValueError, RuntimeError, KeyError) as e:
        raise EngineUnavailable(f"gigatoken cannot load it ({_first_line(e)})") from e


def gigatoken_from_sentencepiece(
    path: Path, prefix: list[int], control_ids: set[int]
) -> GigatokenEngine:
    """gigatoken for a `.model`. gigatoken's conversion matches the control pieces (`<s>`,
    `</s>`) inside text, where sentencepiece reads them as plain text, so they are dropped from
    the converted tokenizer's added tokens (the ids stay in its vocabulary)."""
    gigatoken = _import_gigatoken()
    try:
        from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

        spec = json.loads(sentencepiece_to_tokenizer_json(path.read_bytes()))
        added = spec.get("added_tokens") or []
        spec["added_tokens"] = [t for t in added if t.get("id") not in control_ids]
        return GigatokenEngine(gigatoken.Tokenizer.from_json(json.dumps(spec)), prefix, [])
    except (ImportError, ValueError, RuntimeError, KeyError) as e:
        raise EngineUnavailable(f"gigatoken cannot load it ({_first_line(e)})") from e


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _import_gigatoken() -> Any:
    try:
        import gigatoken
    except ImportError as e:
        raise EngineUnavailable("gigatoken is not installed (pip install gigatoken)") from e
    return gigatoken


def post_processor_affixes(post: dict | None) -> tuple[list[int], list[int]]:
    """The ids a `tokenizers` post-processor adds around a single sequence.

    Only forms whose effect is a fixed prefix/suffix are handled; others are left to
    `tokenizers` itself (EngineUnavailable).
    """
    if post is None or post.get("type") == "ByteLevel":
        return [], []
    if post.get("type") == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for step in post.get("processors", []):
            p, s = post_processor_affixes(step)
            prefix, suffix = prefix + p, s + suffix
        return prefix, suffix
    if post.get("type") != "TemplateProcessing":
        raise EngineUnavailable(f"post-processor {post.get('type')} is not replicated")
    specials = post.get("special_tokens", {})
    prefix, suffix = [], []
    target = prefix
    for piece in post.get("single", []):
        if "Sequence" in piece:
            target = suffix
        else:
            target.extend(specials[piece["SpecialToken"]["id"]]["ids"])
    return prefix, suffix


def json_sections(text: str, wanted: tuple[str, ...]) -> dict[str, Any]:
    """The `wanted` top-level values of a JSON object, parsing no more of `text` than needed.

    A tokenizer.json keeps its large `model` last; parsing the whole file would cost more than
    the rest of start-up. Raises ValueError for text that is not a JSON object.
    """
    decoder = json.JSONDecoder()
    found: dict[str, Any] = {}
    pos = _skip_space(text, 0)
    if not text.startswith("{", pos):
        raise ValueError("not a JSON object")
    pos = _skip_space(text, pos + 1)
    while not text.startswith("}", pos) and len(found) < len(wanted):
        key, pos = decoder.raw_decode(text, pos)
        pos = _skip_space(text, pos)
        if not text.startswith(":", pos):
            raise ValueError(f"expected ':' after key {key!r}")
        value, pos = decoder.raw_decode(text, _skip_space(text, pos + 1))
        if key in wanted:
            found[key] = value
        pos = _skip_space(text, pos)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
    return found


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _pack(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


def _add_affixes(
    flat: np.ndarray, offsets: np.ndarray, prefix: list[int], suffix: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Put `prefix` before and `suffix` after every text's ids (vectorized)."""
    n, p, s = len(offsets) - 1, len(prefix), len(suffix)
    counts = np.diff(offsets)
    new_offsets = offsets + np.arange(n + 1, dtype=np.int64) * (p + s)
    out = np.empty(int(new_offsets[-1]), dtype=flat.dtype)
    shift = np.repeat(new_offsets[:-1] + p - offsets[:-1], counts)
    out[np.arange(len(flat)) + shift] = flat
    for j, token in enumerate(prefix):
        out[new_offsets[:-1] + j] = token
    for j, token in enumerate(suffix):
        out[new_offsets[1:] - s + j] = token
    return out, new_offsets
