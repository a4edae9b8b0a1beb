"""Tokenizer adapters for every command that tokenizes: Hugging Face `tokenizer.json`,
SentencePiece `.model`, GPT-2 `vocab.json` + `merges.txt`.

All three give what Megatron's default tokenizers give: the text's own tokens, no special tokens
added unless asked (`add_special_tokens`, Megatron's `--tokenizer-hf-include-special-tokens`).
Encoding runs on `gigatoken` (a Rust BPE engine) wherever it is proven, by a self-test at load
(`pipeline.tokenizer.engine_proof`), to give the reference library's ids: `tokenizers` for
`tokenizer.json` and GPT-2 files, `sentencepiece` for a `.model`. Otherwise the reference runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.common.hashing import sha256_file
from pipeline.tokenizer import engines

# Names tried, in order, for the end-of-document token when no tokenizer_config.json says.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
# auto: gigatoken where proven identical; gigatoken: that or fail; tokenizers: the reference
# library only (sentencepiece for a .model).
ENGINES = ("auto", "gigatoken", "tokenizers")


class TokenizerError(ValueError):
    """The tokenizer could not be found or loaded (the message names the path)."""


@dataclass
class TextTokenizer:
    """A loaded tokenizer: what it is (`kind`, `files`, `vocab_size`, `eod`) and how it encodes."""

    kind: str  # "hf" | "sentencepiece" | "gpt2"
    files: list[Path]
    vocab_size: int
    eod: int | None
    engine: str  # "gigatoken" | "tokenizers" | "sentencepiece"
    add_special_tokens: bool = False
    engine_note: str = ""  # why gigatoken was not used, when it was not
    _encoder: Any = field(default=None, repr=False)  # an engines.* object
    _reference: Any = field(default=None, repr=False)  # builds the reference engine on demand
    _sha256: dict[Path, str] = field(default_factory=dict, repr=False)

    def encode_packed(
        self, texts: list[str], threads: str = engines.POOL
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all texts back to back, and offsets (len(texts) + 1) into them;
        `threads` says where the batch may run (engines.POOL, SHARED or ALONE)."""
        return self._encoder.encode_packed(texts, threads)

    @property
    def serial_batches(self) -> bool:
        """Whether batches encode on the calling thread (so threads can encode side by side)."""
        return self._encoder.serial_batches

    @property
    def forks(self) -> bool:
        """Whether the engine encodes (with engines.ALONE) in a forked copy of the process."""
        return self._encoder.forks

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as lists."""
        flat, offsets = self.encode_packed(texts)
        return [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` by the reference library: special tokens kept visible unless
        `skip_special_tokens` (what a served reply does by default, as vLLM's)."""
        return self._reference().decode(ids, skip_special_tokens)

    def file_sha256(self, path: Path) -> str:
        if path not in self._sha256:
            self._sha256[path] = sha256_file(path)
        return self._sha256[path]

    def fingerprint(self) -> dict:
        """What identifies this tokenizer in a manifest: files with sizes and SHA-256."""
        return {
            "kind": self.kind,
            "engine": self.engine,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "add_special_tokens": self.add_special_tokens,
            "files": [
                {"path": str(p), "bytes": p.stat().st_size, "sha256": self.file_sha256(p)}
                for p in self.files
            ],
        }


def load_tokenizer(
    path: str | os.PathLike,
    *,
    merge_file: str | os.PathLike | None = None,
    add_special_tokens: bool = False,
    engine: str = "auto",
) -> TextTokenizer:
    """Load a tokenizer from a directory or a file.

    A directory is searched for `tokenizer.json`, then `tokenizer.model`, then `vocab.json` +
    `merges.txt`. `engine` picks the encoding engine: "auto" uses gigatoken where its self-test
    proves it identical to the reference library, "gigatoken" fails where it cannot be used,
    "tokenizers" runs only the reference library.
    """
    if engine not in ENGINES:
        raise TokenizerError(f"unknown tokenizer engine {engine!r}; choose from {ENGINES}")
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"{path}: tokenizer not found")
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise TokenizerError(
                f"{path}: no tokenizer.json, tokenizer.model or vocab.json + merges.txt in it"
            )
    if path.suffix == ".model":
        tok, build_gigatoken = _sentencepiece_tokenizer(path, add_special_tokens)
    elif path.name == "vocab.json" or merge_file is not None:
        merges = Path(merge_file) if merge_file else path.with_name("merges.txt")
        tok, build_gigatoken = _gpt2_tokenizer(path, merges, add_special_tokens)
    elif path.suffix == ".json":
        tok, build_gigatoken = _hf_tokenizer(path, add_special_tokens)
    else:
        raise TokenizerError(
            f"{path}: not a tokenizer file (expected tokenizer.json, a SentencePiece .model, "
            "or vocab.json with merges.txt)"
        )
    _choose_engine(tok, build_gigatoken, engine)
    return tok


# What a tokenizer directory holds that pipe reads: the vocabulary (one of the first three), the
# special tokens, the chat template.
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DIRECTORY_FILES = (
    *_VOCABULARY_FILES,
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def directory_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    """What a checkpoint records about the tokenizer files in `directory` (a Hugging Face
    model's), without loading them: where they are and each file's size and SHA-256, in the
    shape of a training run's record, so later commands find the same files again, or notice
    they changed. None when the directory holds no vocabulary file."""
    directory = Path(directory).resolve()
    if not any((directory / name).is_file() for name in _VOCABULARY_FILES):
        return None
    files = [directory / name for name in _DIRECTORY_FILES if (directory / name).is_file()]
    return {
        "source": f"tokenizer:{directory}",
        "fingerprint": {
            "files": [
                {"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files
            ]
        },
    }


# --------------------------------------------------------------------------------- loaders
# Each returns the tokenizer (encoding with its reference library) and how to build gigatoken.

_Loaded = tuple[TextTokenizer, Callable[[], engines.GigatokenEngine]]


class _Lazy:
    """Builds a value once, on first call (the reference engine is only loaded when needed)."""

    def __init__(self, build) -> None:
        self._build, self._value = build, None

    def __call__(self) -> Any:
        if self._value is None:
            self._value = self._build()
        return self._value


def _hf_tokenizer(path: Path, add_special_tokens: bool) -> _Loaded:
    """A tokenizer.json. Its eod and post-processing come from the file's small top-level
    sections, so the `tokenizers` reference is only loaded if the engine proof needs it."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
        sections = engines.json_sections(text, ("added_tokens", "post_processor"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e
    config_file = path.with_name("tokenizer_config.json")
    added = {t["content"]: t["id"] for t in sections.get("added_tokens") or []}

    def reference() -> engines.TokenizersEngine:
        from tokenizers import Tokenizer

        try:
            return engines.TokenizersEngine(Tokenizer.from_str(text), add_special_tokens)
        except Exception as e:  # tokenizers raises bare Exceptions for malformed files
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e

    tok = TextTokenizer(
        kind="hf",
        files=[path] + ([config_file] if config_file.is_file() else []),
        vocab_size=0,  # set with the engine
        eod=_hf_eod(added, config_file),
        engine="tokenizers",
        add_special_tokens=add_special_tokens,
        _reference=_Lazy(reference),
    )
    tok._sha256[path] = hashlib.sha256(raw).hexdigest()
    post = sections.get("post_processor") if add_special_tokens else None
    return tok, lambda: engines.gigatoken_from_json(text, post)


def _gpt2_tokenizer(vocab: Path, merges: Path, add_special_tokens: bool) -> _Loaded:
    """GPT-2 style files, encoded as Megatron's GPT2BPETokenizer does (byte-level BPE with the
    GPT-2 split regex; `<|endoftext|>` is the end-of-document id, not matched inside text)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if not merges.is_file():
        raise TokenizerError(f"{merges}: merges file not found (needed beside {vocab})")
    _check_merges(merges)
    try:
        model = BPE.from_file(str(vocab), str(merges))
    except Exception as e:
        raise TokenizerError(f"{vocab}, {merges}: not a valid GPT-2 vocabulary ({e})") from e
    reference = Tokenizer(model)
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    payload = reference.to_str()
    vocab_map = reference.get_vocab()
    tok = TextTokenizer(
        kind="gpt2",
        files=[vocab, merges],
        vocab_size=len(vocab_map),
        eod=vocab_map.get("<|endoftext|>"),
        engine="tokenizers",
        add_special_tokens=add_special_tokens,
        _reference=_Lazy(lambda: engines.TokenizersEngine(reference, add_special_tokens)),
    )
    return tok, lambda: engines.gigatoken_from_json(payload, None)


def _check_merges(merges: Path) -> None:
    """Refuse an empty or cut merges file, which the BPE reader would take as a different
    valid vocabulary: GPT-2's format ends every line, the last included, with a newline."""
    try:
        text = merges.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{merges}: not UTF-8 text ({e})") from None
    pairs = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not pairs:
        raise TokenizerError(f"{merges}: no merges in it (empty or truncated file)")
    if not text.endswith("\n"):
        raise TokenizerError(
            f"{merges}: the last line {pairs[-1][:40]!r} has no newline: the file is truncated "
            "(add the newline if the line is whole)"
        )
    bad = next((line for line in pairs if len(line.split()) != 2), None)
    if bad is not None:
        raise TokenizerError(f"{merges}: {bad[:40]!r} is not two tokens separated by a space")


def _sentencepiece_tokenizer(path: Path, add_special_tokens: bool) -> _Loaded:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{path}: not a valid SentencePiece model ({e})") from e
    eos, bos = processor.eos_id(), processor.bos_id()
    prefix = [bos] if add_special_tokens and bos >= 0 else []
    tok = TextTokenizer(
        kind="sentencepiece",
        files=[path],
        vocab_size=processor.get_piece_size(),
        eod=eos if eos >= 0 else None,
        engine="sentencepiece",
        add_special_tokens=add_special_tokens,
        _reference=_Lazy(lambda: engines.SentencePieceEngine(processor, prefix)),
    )
    controls = {i for i in range(processor.get_piece_size()) if processor.is_control(i)}
    return tok, lambda: engines.gigatoken_from_sentencepiece(path, prefix, controls)


def _hf_eod(added: dict[str, int], config_file: Path) -> int | None:
    """End-of-document id: tokenizer_config.json's eos_token, else a well-known EOS string,
    among the added tokens (where every Hugging Face tokenizer keeps its EOS)."""
    if config_file.is_file():
        try:
            eos = json.loads(config_file.read_bytes().decode("utf-8")).get("eos_token")
        except (UnicodeDecodeError, ValueError, AttributeError) as e:
            raise TokenizerError(f"{config_file}: not a readable JSON object ({e})") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos in added:
            return added[eos]
    return next((added[name] for name in _EOS_CANDIDATES if name in added), None)


# --------------------------------------------------------------------------------- engines


def _choose_engine(
    tok: TextTokenizer, build_gigatoken: Callable[[], engines.GigatokenEngine], engine: str
) -> None:
    """Encode with gigatoken when allowed and proven identical to the reference; otherwise with
    the reference (with a note saying why), or fail when gigatoken was forced."""
    from pipeline.tokenizer.engine_proof import EngineMismatch, prove

    if engine == "tokenizers":
        tok.engine_note = "reference engine requested"
        _use_reference(tok)
        return
    try:
        fast = build_gigatoken()
        prove(fast, tok._reference, key=_proof_key(tok))
    except (engines.EngineUnavailable, EngineMismatch) as e:
        if engine == "gigatoken":
            raise TokenizerError(f"{tok.files[0]}: the gigatoken engine cannot be used: {e}") from e
        tok.engine_note = f"gigatoken not used: {e}"
        _use_reference(tok)
        return
    tok.engine, tok._encoder = "gigatoken", fast
    tok.vocab_size = tok.vocab_size or fast.vocab_size


def _use_reference(tok: TextTokenizer) -> None:
    reference = tok._reference()
    tok._encoder = reference
    tok.engine = reference.name
    tok.vocab_size = tok.vocab_size or reference.vocab_size


def _proof_key(tok: TextTokenizer) -> str:
    """What a cached proof is valid for: the tokenizer files' contents and the options."""
    parts = [tok.kind, str(tok.add_special_tokens)] + [tok.file_sha256(p) for p in tok.files]
    return "\0".join(parts)
