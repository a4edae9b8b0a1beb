"""Proof at load that gigatoken gives the reference library's ids for one tokenizer.

A self-test encodes the tokenizer's own special and added tokens (alone, inside words, doubled)
and the edge cases where BPE engines differ: empty text, whitespace runs, many scripts, emoji,
control and private-use characters (byte fallback), very long words. Any difference refuses the
engine. A passed proof is remembered under `$XDG_CACHE_HOME/pipe/engine-proofs/` keyed by the
tokenizer files' SHA-256, the options, the library installs and this test's version, so a
second run with the same files skips loading the reference library (about 0.5 s for Llama 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.common.atomic import write_text
from pipeline.tokenizer.engines import ALONE, SHARED

# Bump when the texts below change: proofs made with other texts are then not reused.
SELF_TEST_VERSION = "2"

_EDGE_TEXTS = (
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    "\r\n",
    "   leading and trailing spaces   \t\t\n\r\n",
    "x" + " " * 50 + "y",
    " " * 3000,
    "\n" * 500 + "tail",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "DON'T stop; we're here, they'll go, I've, you'd, she's",
    "numbers 1234567890 3.14159 1e-10 12345678901234567890 ١٢٣ ⅷ",
    "def f(x):\n    return x ** 2  # squares\n\n\n\tif a != b: pass",
    "日本語のテキストと中文文本，还有한국어. Ελληνικά русский עברית العربية हिन्दी ไทย",
    "emoji 👩‍👩‍👧‍👦 and 🎉🎉 plus café naïve e\u0301 ﬁ Ω ǅ İ ß",
    "\u00a0\u3000\u2028\u2029\u200b\u200d\ufeff nbsp and friends",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠀀𪚥 \U0010fffd \ue000 \U000e0001 ꙮ ᚠᛇᚻ ⵜⴰⵎⴰⵣⵉⵖⵜ",
    "\x00\x01\x07\x1b[0m\x7f\x85",
    "\ufffd replacement, ’‘“”…— quotes",
    "a" * 5000,
    "ab" * 2500,
    "word " * 1000,
    "https://example.com/path?q=1&r=%20#frag user@example.org 0xDEADBEEF",
)


class EngineMismatch(RuntimeError):
    """gigatoken and the reference library disagree on a self-test text."""


def prove(engine: Any, reference: Callable[[], Any], *, key: str) -> None:
    """Raise EngineMismatch unless `engine` encodes every self-test text as `reference()` does.

    `reference` is only called (the reference library only loaded) when no cached proof exists
    for `key` (the tokenizer's identity) with the installed libraries.
    """
    proof = _proof_file(key)
    if proof is not None and proof.is_file():
        return
    ref = reference()
    texts = self_test_texts(ref.added_tokens())
    expected = [ref.encode(text) for text in texts]
    for threads in (SHARED, ALONE):  # the batch call and the one-text call
        flat, offsets = engine.encode_packed(texts, threads)
        for i, text in enumerate(texts):
            got = flat[offsets[i] : offsets[i + 1]].tolist()
            if got != expected[i]:
                raise EngineMismatch(
                    f"it differs from {ref.name} on self-test text {text[:40]!r}: "
                    f"{got[:8]} vs {expected[i][:8]}"
                )
    _remember(proof)


def self_test_texts(added_tokens: list[str]) -> list[str]:
    """The edge cases, and each added token alone, inside a word, spaced and doubled."""
    texts = list(_EDGE_TEXTS)
    for token in added_tokens:
        texts += [token, f"a{token}b", f" {token} x", token + token]
    texts.append(" ".join(added_tokens[:50]) + " " + " ".join(_EDGE_TEXTS[11:17]))
    return texts


def _proof_file(key: str) -> Path | None:
    """Where a passed proof for `key` is remembered (None when caching is off: PIPE_NO_CACHE)."""
    if os.environ.get("PIPE_NO_CACHE"):
        return None
    installs = [_installed(name) for name in ("gigatoken", "tokenizers", "sentencepiece")]
    digest = hashlib.sha256("\0".join([SELF_TEST_VERSION, key, *installs]).encode()).hexdigest()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pipe" / "engine-proofs" / digest


def _installed(name: str) -> str:
    """Which install of a library this is, without importing it (importlib.metadata alone costs
    more start-up than the budget allows): its location, size and modification time, which
    any upgrade or reinstall changes."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return f"{name} absent"
    stat = os.stat(spec.origin)
    return f"{name} {spec.origin} {stat.st_size} {stat.st_mtime_ns}"


def _remember(proof: Path | None) -> None:
    """Record a passed proof; a cache that cannot be written only costs the next run time."""
    if proof is None:
        return
    with contextlib.suppress(OSError):
        write_text(proof, "passed\n")
