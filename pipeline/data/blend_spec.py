"""Blend specifications, parsed as Megatron parses them: `--data "0.7 a 0.3 b"` or unweighted
prefixes, a blend file (`--data-args-path`), and one blend per split (train/valid/test strings or a
JSON file, as `--per-split-data-args-path`).

Deliberate differences from Megatron, all refusals with a clear error: weights that are zero,
negative, NaN or infinite; a weight list that is half numbers and half not (Megatron then reads
every token as a prefix); missing `.bin`/`.idx` files; datasets with different token dtypes or
different tokenizers (from their preprocessing manifests) in one blend.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data import manifest
from pipeline.data.gpt_dataset import SPLIT_NAMES
from pipeline.data.indexed import bin_path, idx_path, normalize_prefix, read_index_header

MAX_DATASETS = 32766  # dataset ids are int16

# ----------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their weights (None: unweighted): Megatron's `(prefixes, weights)`."""

    prefixes: list[str]
    weights: list[float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefixes", [str(p) for p in self.prefixes])
        if not self.prefixes:
            raise ValueError("a blend needs at least one dataset prefix")
        if self.weights is None:
            return
        object.__setattr__(self, "weights", [float(w) for w in self.weights])
        if len(self.weights) != len(self.prefixes):
            raise ValueError(
                f"a blend needs one weight per prefix: {len(self.weights)} weights for "
                f"{len(self.prefixes)} prefixes"
            )
        for prefix, weight in zip(self.prefixes, self.weights):
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"{prefix}: weight {weight} must be finite and greater than zero")


@dataclass(frozen=True)
class PerSplitBlend:
    """One blend per split (`--train-data-path` etc.); each split uses the whole of its datasets."""

    train: Blend | None = None
    valid: Blend | None = None
    test: Blend | None = None

    def __post_init__(self) -> None:
        if not any(self.splits()):
            raise ValueError("a per-split blend needs a blend for at least one split")

    def splits(self) -> list[Blend | None]:
        return [self.train, self.valid, self.test]


@dataclass(frozen=True)
class MockData:
    """Generated data instead of files (`--mock-data`), with the tokenizer's vocabulary size."""

    vocab_size: int


def _as_number(token: str) -> float | None:
    """`token` as a float the way Megatron reads weights (`float()`), or None if it is not one."""
    try:
        return float(token)
    except ValueError:
        return None


def parse_blend(tokens: str | Sequence[str], source: str = "--data") -> Blend:
    """Read a blend from `--data` tokens: `"0.7 a 0.3 b"` (weight, prefix pairs) or `"a b c"`.

    As Megatron: an odd number of tokens is a list of prefixes; an even number is weight/prefix
    pairs when every weight position is a number and a list of prefixes when none is. Unlike
    Megatron, a mix of the two, weights that are not finite and positive, and a list of prefixes
    that contains a number (a weight whose prefix is missing, or pairs written prefix first) are
    refused. `source` names where the tokens came from in error messages.
    """
    items = tokens.split() if isinstance(tokens, str) else [str(t).strip() for t in tokens]
    items = [t for t in items if t]
    if not items:
        raise ValueError(f"{source}: the blend is empty (give prefixes, or weight/prefix pairs)")
    weight_tokens, prefixes = items[0::2], items[1::2]
    weights = [_as_number(t) for t in weight_tokens]
    if len(items) % 2 == 1 or all(w is None for w in weights):
        numbers = [t for t in items if _as_number(t) is not None]
        if numbers:
            raise ValueError(
                f"{source}: {numbers[0]!r} looks like a weight, but the tokens do not read as "
                "'WEIGHT PREFIX' pairs; give a prefix after every weight, or no weights at all"
            )
        return Blend(items, None)
    if any(w is None for w in weights):
        bad = weight_tokens[weights.index(None)]
        good = weight_tokens[next(i for i, w in enumerate(weights) if w is not None)]
        raise ValueError(
            f"{source}: ambiguous blend: {good!r} reads as a weight but {bad!r} (in a weight "
            "position) does not; write 'WEIGHT PREFIX' pairs throughout, or prefixes only"
        )
    for token, weight in zip(weight_tokens, weights):
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"{source}: weight {token!r} must be a finite number greater than zero"
            )
    return Blend(prefixes, [float(w) for w in weights])


def read_blend_file(path: str | os.PathLike) -> Blend:
    """A blend from a file of whitespace-separated tokens (Megatron's `--data-args-path`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{path}: cannot read the blend file ({err.strerror or err})") from err
    return parse_blend(text.split(), source=str(path))


def parse_per_split_blend(
    train: str | Sequence[str] | None = None,
    valid: str | Sequence[str] | None = None,
    test: str | Sequence[str] | None = None,
) -> PerSplitBlend:
    """Per-split blends from `--train-data-path`, `--valid-data-path`, `--test-data-path`."""
    blends = [
        None if tokens is None else parse_blend(tokens, source=f"--{name}-data-path")
        for name, tokens in zip(SPLIT_NAMES, (train, valid, test))
    ]
    return PerSplitBlend(*blends)


def read_per_split_blend_file(path: str | os.PathLike) -> PerSplitBlend:
    """Per-split blends from a JSON object with keys train, valid and test, each a whitespace
    separated string, a list of tokens, or null (Megatron's `--per-split-data-args-path`)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot read the blend file ({err.strerror or err})") from err
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object with keys {list(SPLIT_NAMES)}")
    missing = [name for name in SPLIT_NAMES if name not in record]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}; all of {list(SPLIT_NAMES)} are needed")
    blends = []
    for name in SPLIT_NAMES:
        value = record[name]
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError(f"{path}: {name!r} must be a string, a list or null")
        blends.append(None if value is None else parse_blend(value, source=f"{path} [{name}]"))
    return PerSplitBlend(*blends)


def check_prefixes_exist(prefixes: Sequence[str]) -> None:
    """Raise FileNotFoundError naming every missing `.bin`/`.idx` of the blend's prefixes."""
    missing = [
        str(path)
        for prefix in prefixes
        for path in (bin_path(prefix), idx_path(prefix))
        if not path.is_file()
    ]
    if missing:
        raise FileNotFoundError(
            "missing indexed-dataset file(s): " + ", ".join(missing) + " (a blend names prefixes "
            "such as out/corpus_text_document, without .bin/.idx)"
        )


def check_compatible(prefixes: Sequence[str]) -> None:
    """Refuse a blend whose datasets differ in token dtype, or in tokenizer where their
    preprocessing manifests say which (datasets without a manifest get the dtype check only)."""
    dtypes = {prefix: read_index_header(idx_path(prefix)).dtype for prefix in prefixes}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p} ({d})" for p, d in dtypes.items())
        raise ValueError(
            f"the blend mixes token dtypes: {listing}; every dataset of a blend must be "
            "preprocessed with the same tokenizer"
        )
    tokenizers = {p: t for p in prefixes if (t := _tokenizer_identity(p)) is not None}
    if len(set(tokenizers.values())) > 1:
        (first, a), (other, b) = next(
            ((p, t), (q, u)) for p, t in tokenizers.items() for q, u in tokenizers.items() if t != u
        )
        raise ValueError(
            f"the blend mixes tokenizers: {first} was made with vocab size {a[0]} "
            f"(tokenizer files sha256 {', '.join(h[:12] for h in a[1]) or 'none'}), {other} with "
            f"vocab size {b[0]} ({', '.join(h[:12] for h in b[1]) or 'none'}); re-tokenize one "
            "of them"
        )


def _tokenizer_identity(prefix: str) -> tuple[Any, tuple[str, ...]] | None:
    """(vocab size, sorted tokenizer-file hashes) from the prefix's preprocessing manifest."""
    path = manifest.find_for_dataset(prefix)
    record = manifest.read(path) if path is not None else None
    if record is None:
        return None
    tokenizer = record.get("tokenizer") or {}
    hashes = tuple(sorted(str(f.get("sha256")) for f in tokenizer.get("files") or []))
    return tokenizer.get("vocab_size"), hashes


def all_prefixes(data: Blend | PerSplitBlend) -> list[str]:
    """Every distinct prefix a blend or per-split blend names, in order."""
    blends = [data] if isinstance(data, Blend) else [b for b in data.splits() if b is not None]
    return list(dict.fromkeys(normalize_prefix(p) for b in blends for p in b.prefixes))
