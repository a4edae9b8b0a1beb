"""Tokenizer adapters for preprocessing: Hugging Face `tokenizer.json`, SentencePiece `.model`,
GPT-2 `vocab.json` + `merges.txt`.

All three give what Megatron's default tokenizers give: the text's own tokens, no special tokens
added unless asked (`add_special_tokens`, Megatron's `--tokenizer-hf-include-special-tokens`). For
byte-level BPE vocabularies the tiktoken-based engine in `fast_bpe` is used when it is provably
identical to `tokenizers`; otherwise `tokenizers` itself runs.

A `TextTokenizer` is cheap to pickle: worker processes receive it and build their engine lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Names tried, in order, for the end-of-document token when no tokenizer_config.json says.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
ENGINES = ("auto", "tiktoken", "tokenizers")


class TokenizerError(ValueError):
    """The tokenizer could not be found or loaded (the message names the path)."""


@dataclass
class TextTokenizer:
    """A loaded tokenizer: what it is (`kind`, `files`, `vocab_size`, `eod`) and how it encodes."""

    kind: str  # "hf" | "sentencepiece" | "gpt2"
    files: list[Path]
    vocab_size: int
    eod: int | None
    engine: str  # "tiktoken" | "tokenizers" | "sentencepiece"
    add_special_tokens: bool = False
    engine_note: str = ""  # why the fast engine was not used, when it was not
    _prefix: list[int] = field(default_factory=list)  # post-processing ids (fast engine only)
    _suffix: list[int] = field(default_factory=list)
    _payload: Any = None  # picklable state the engine is built from
    _impl: Any = field(default=None, repr=False)
    _decoder: Any = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _decoder=None)
        if self.engine != "tiktoken":  # the FastBPE object itself pickles compactly
            state["_impl"] = None
        return state

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""
        impl = self._engine()
        if self.engine == "tiktoken":
            ids = impl.encode_batch(texts)
            if self._prefix or self._suffix:
                ids = [self._prefix + x + self._suffix for x in ids]
            return ids
        if self.engine == "tokenizers":
            # encode_batch_fast (tokenizers >= 0.21) skips offset tracking: same ids, ~20% faster.
            encode = getattr(impl, "encode_batch_fast", impl.encode_batch)
            encodings = encode(texts, add_special_tokens=self.add_special_tokens)
            return [e.ids for e in encodings]
        ids = impl.encode(texts)
        if self.add_special_tokens and impl.bos_id() >= 0:
            ids = [[impl.bos_id(), *x] for x in ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens kept visible)."""
        if self.kind == "sentencepiece":
            return self._engine().decode(ids)
        return self._reference().decode(ids, skip_special_tokens=False)

    def _engine(self) -> Any:
        if self._impl is None:
            if self.engine == "sentencepiece":
                self._impl = _load_sentencepiece(self.files[0])
            else:
                self._impl = self._reference()
        return self._impl

    def _reference(self) -> Any:
        """The `tokenizers` object (also used for decoding when the fast engine encodes)."""
        if self.engine == "tokenizers" and self._impl is not None:
            return self._impl
        if self._decoder is None:
            from tokenizers import Tokenizer

            self._decoder = Tokenizer.from_str(self._payload)
        return self._decoder

    def fingerprint(self) -> dict:
        """What identifies this tokenizer in a manifest: files with sizes and SHA-256."""
        return {
            "kind": self.kind,
            "engine": self.engine,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "add_special_tokens": self.add_special_tokens,
            "files": [
                {"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                for p in self.files
            ],
        }


def sha256_file(
    path: str | os.PathLike, block: int = 1 << 22, *, start: int = 0, end: int | None = None
) -> str:
    """Hex SHA-256 of a file, or of its bytes [start, end), read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        remaining = float("inf") if end is None else end - start
        while remaining > 0 and (chunk := f.read(int(min(block, remaining)))):
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def load_tokenizer(
    path: str | os.PathLike,
    *,
    merge_file: str | os.PathLike | None = None,
    add_special_tokens: bool = False,
    engine: str = "auto",
) -> TextTokenizer:
    """Load a tokenizer from a directory or a file.

    A directory is searched for `tokenizer.json`, then `tokenizer.model`, then `vocab.json` +
    `merges.txt`. `engine` forces the encoding engine for `tokenizer.json` vocabularies:
    "tiktoken" fails if the fast engine is not provably identical, "tokenizers" never uses it.
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
        return _sentencepiece_tokenizer(path, add_special_tokens)
    if path.name == "vocab.json" or merge_file is not None:
        merges = Path(merge_file) if merge_file else path.with_name("merges.txt")
        return _gpt2_tokenizer(path, merges, add_special_tokens, engine)
    if path.suffix == ".json":
        return _hf_tokenizer(path, add_special_tokens, engine)
    raise TokenizerError(
        f"{path}: not a tokenizer file (expected tokenizer.json, a SentencePiece .model, "
        "or vocab.json with merges.txt)"
    )


def _hf_tokenizer(path: Path, add_special_tokens: bool, engine: str) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        text = path.read_bytes().decode("utf-8")
        reference = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises bare Exceptions for malformed files
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e
    config_file = path.with_name("tokenizer_config.json")
    files = [path] + ([config_file] if config_file.is_file() else [])
    tok = TextTokenizer(
        kind="hf",
        files=files,
        vocab_size=reference.get_vocab_size(with_added_tokens=True),
        eod=_hf_eod(reference, config_file),
        engine="tokenizers",
        add_special_tokens=add_special_tokens,
        _payload=text,
        _impl=reference,
    )
    _maybe_use_fast_engine(tok, json.loads(text), engine)
    return tok


def _gpt2_tokenizer(vocab: Path, merges: Path, add_special_tokens: bool, engine: str):
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
    vocab_map = reference.get_vocab()
    tok = TextTokenizer(
        kind="gpt2",
        files=[vocab, merges],
        vocab_size=len(vocab_map),
        eod=vocab_map.get("<|endoftext|>"),
        engine="tokenizers",
        add_special_tokens=add_special_tokens,
        _payload=reference.to_str(),
        _impl=reference,
    )
    _maybe_use_fast_engine(tok, json.loads(tok._payload), engine)
    return tok


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


def _sentencepiece_tokenizer(path: Path, add_special_tokens: bool) -> TextTokenizer:
    processor = _load_sentencepiece(path)
    eos = processor.eos_id()
    return TextTokenizer(
        kind="sentencepiece",
        files=[path],
        vocab_size=processor.get_piece_size(),
        eod=eos if eos >= 0 else None,
        engine="sentencepiece",
        add_special_tokens=add_special_tokens,
        _impl=processor,
    )


def _load_sentencepiece(path: Path) -> Any:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{path}: not a valid SentencePiece model ({e})") from e
    return processor


def _hf_eod(reference: Any, config_file: Path) -> int | None:
    """End-of-document id: tokenizer_config.json's eos_token, else a well-known EOS string."""
    if config_file.is_file():
        try:
            eos = json.loads(config_file.read_bytes().decode("utf-8")).get("eos_token")
        except (UnicodeDecodeError, ValueError, AttributeError) as e:
            raise TokenizerError(f"{config_file}: not a readable JSON object ({e})") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and reference.token_to_id(eos) is not None:
            return reference.token_to_id(eos)
    for name in _EOS_CANDIDATES:
        if (token_id := reference.token_to_id(name)) is not None:
            return token_id
    return None


def _maybe_use_fast_engine(tok: TextTokenizer, spec: dict, engine: str) -> None:
    """Switch `tok` to the tiktoken engine when allowed and provably identical."""
    if engine == "tokenizers":
        tok.engine_note = "tokenizers engine requested"
        return
    from pipeline.preprocess.fast_bpe import FastBPE, NotEligible

    try:
        if tok.add_special_tokens:
            tok._prefix, tok._suffix = _post_processor_affixes(spec.get("post_processor"))
        fast = FastBPE.from_tokenizer_json(tok._payload)
    except NotEligible as e:
        if engine == "tiktoken":
            raise TokenizerError(f"{tok.files[0]}: the tiktoken engine cannot be used: {e}") from e
        tok.engine_note = str(e)
        return
    tok.engine, tok._impl = "tiktoken", fast


def _post_processor_affixes(post: dict | None) -> tuple[list[int], list[int]]:
    """The ids a `tokenizers` post-processor adds around a single sequence.

    Only forms whose effect is a fixed prefix/suffix are handled; others leave the work to
    `tokenizers` itself (NotEligible).
    """
    from pipeline.preprocess.fast_bpe import NotEligible

    if post is None or post.get("type") == "ByteLevel":
        return [], []
    if post.get("type") == "Sequence":
        prefix, suffix = [], []
        for step in post.get("processors", []):
            p, s = _post_processor_affixes(step)
            prefix, suffix = prefix + p, s + suffix
        return prefix, suffix
    if post.get("type") != "TemplateProcessing":
        raise NotEligible(f"post-processor {post.get('type')} adds tokens in a way not replicated")
    specials = post.get("special_tokens", {})
    prefix: list[int] = []
    suffix: list[int] = []
    target = prefix
    for piece in post.get("single", []):
        if "Sequence" in piece:
            target = suffix
        else:
            target.extend(specials[piece["SpecialToken"]["id"]]["ids"])
    return prefix, suffix
