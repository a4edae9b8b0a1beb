"""A tiktoken-backed encoder that gives the same ids as Hugging Face ``tokenizers``.

For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style) tiktoken's Rust core is several times
faster than ``tokenizers``. The two engines pick merges differently, though: ``tokenizers`` merges
the adjacent pair with the lowest *merge index*, tiktoken the adjacent pair whose *concatenated
bytes* have the lowest rank, and tiktoken returns a whole pre-token found in the vocabulary
without merging. :meth:`FastBPE.from_tokenizer_json` therefore only builds an engine after proving
that, for this tokenizer, both rules give the same tokens; otherwise it raises
:class:`NotEligible` naming the failed condition, and the caller keeps using ``tokenizers``.

Both engines start a pre-token from single bytes and repeatedly join one adjacent pair of parts,
taking the leftmost on a tie. Checks, with the argument why they suffice:

* (A) merges producing the same token are contiguous in the merge list. Ranking each token by the
  index of its group then orders pairs with *different* results exactly as the merge list does.
* Locality: parts never split, so the bytes of two adjacent parts x, y were merged as if alone,
  and BPE of the bytes of x+y alone passes through the state [x, y]. That run is deterministic
  and has one two-part state, so every pair ever seen with result t is the same pair, and ties
  between pairs with the same result are broken leftmost by both engines.
* (B) ``tokenizers``' merge loop run on each vocabulary token never stops at exactly two parts.
  By induction on length (both engines agree on shorter inputs, so on every state of the run
  except a final two-part one), a two-part stop is the only way the engines can disagree on a
  token's own bytes, and a pair x, y tiktoken could join but ``tokenizers`` could not would, by
  locality, produce such a stop on the bytes of x+y. Tokens whose BPE ends in three or more
  parts are never formed by merging in either engine.
* (D) tiktoken returns a pre-token that is in its vocabulary without merging; ``tokenizers``
  does so only with ``ignore_merges``. Without it, tokens merging cannot form are left out of
  tiktoken's vocabulary (harmless, it never forms them) and the rest do merge into themselves.

Merges' parts need not be formed before their result: Llama 3 has merges like 'Ġ' + 'ĠĠĠ' ->
'ĠĠĠĠ' where 'ĠĠĠ' ranks after 'ĠĠĠĠ', and a split of a token into two tokens need not be a
merge (trained GPT-2-style vocabularies have one merge per token, say 'th' + 'e' -> 'the', even
where 't' and 'he' are tokens too).

The pre-tokenizer regex, added tokens and normalizer are checked separately, and a load-time
self-check compares both engines on tricky text.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FastBPE", "NotEligible"]

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_UNICODE_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")


class NotEligible(ValueError):
    """The tokenizer cannot be run by the fast engine with identical ids; str(e) says why."""


@dataclass(frozen=True)
class _AddedToken:
    """An added token as ``tokenizers`` matches it in text before the model runs."""

    content: str
    id: int
    normalized: bool


@dataclass
class _Plan:
    """Everything needed to (re)build the tiktoken engine; this is what gets pickled."""

    pattern: str
    tokens: list[bytes]  # mergeable tokens, tokens[i] has tiktoken rank ranks[i]
    ranks: np.ndarray
    specials: dict[str, int]  # added-token content -> tiktoken id
    rank_to_id: np.ndarray | None  # None when tiktoken ids already are the HF ids
    normalizers: tuple[str, ...]
    added: tuple[_AddedToken, ...]
    native_specials: bool  # tiktoken's own special-token matching is exact for this tokenizer


# ---------------------------------------------------------------------------------------------
# Byte-level alphabet


def _byte_level_alphabet() -> dict[str, int]:
    """Map each character of GPT-2's bytes-to-unicode alphabet back to its byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100.. in
    byte order, so every byte has a visible, non-space character.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(0x100 + shifted)] = b
            shifted += 1
    return chars


_ALPHABET = _byte_level_alphabet()
# str.translate table turning alphabet characters into the Latin-1 character of their byte; other
# Latin-1 characters become U+FFFF so that the following .encode("latin-1") rejects them.
_TO_LATIN1 = {c: 0xFFFF for c in range(256)} | {ord(c): b for c, b in _ALPHABET.items()}


def _token_bytes(token: str) -> bytes:
    """Decode a byte-level vocabulary string to raw bytes; NotEligible if it is not byte-level."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        raise NotEligible(
            f"vocabulary token {token!r} has a character outside the byte-level alphabet"
        ) from None


# ---------------------------------------------------------------------------------------------
# Configuration checks (normalizer, pre-tokenizer, model options, added tokens)


def _check_options(spec: dict[str, Any]) -> None:
    """Refuse truncation/padding and BPE options tiktoken has no equivalent for."""
    if spec.get("truncation") is not None:
        raise NotEligible("truncation is configured in tokenizer.json")
    if spec.get("padding") is not None:
        raise NotEligible("padding is configured in tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotEligible(f"model type is {model.get('type')!r}, not 'BPE'")
    if model.get("dropout") not in (None, 0, 0.0):
        raise NotEligible("BPE dropout is set")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotEligible(f"BPE {key} is set")
    if model.get("byte_fallback"):
        raise NotEligible("BPE byte_fallback is on (SentencePiece-style, not byte-level)")
    if not model.get("merges"):
        raise NotEligible("BPE model has no merges")


def _check_normalizer(normalizer: dict[str, Any] | None) -> tuple[str, ...]:
    """Return the Unicode normalization forms to apply in order; refuse anything else."""
    if normalizer is None:
        return ()
    kind = normalizer.get("type")
    if kind in _UNICODE_NORMALIZERS:
        return (kind,)
    if kind == "Sequence":
        forms: list[str] = []
        for sub in normalizer.get("normalizers", []):
            forms.extend(_check_normalizer(sub))
        return tuple(forms)
    raise NotEligible(f"normalizer {kind!r} is not supported (only NFC/NFD/NFKC/NFKD)")


def _byte_level_ok(pre: dict[str, Any], use_regex: bool) -> bool:
    """Whether ``pre`` is a ByteLevel pre-tokenizer with the given use_regex and no prefix space."""
    return (
        pre.get("type") == "ByteLevel"
        and bool(pre.get("use_regex", True)) == use_regex
        and not pre.get("add_prefix_space", True)
    )


def _check_pre_tokenizer(pre: dict[str, Any] | None) -> str:
    """Return the split regex of a byte-level pre-tokenizer tiktoken can reproduce."""
    if pre is None:
        raise NotEligible("no pre-tokenizer (not a byte-level BPE)")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and _byte_level_ok(steps[0], use_regex=True):
        return _GPT2_PATTERN
    if len(steps) == 2 and _byte_level_ok(steps[1], use_regex=False):
        split = steps[0]
        if split.get("type") != "Split":
            raise NotEligible(f"pre-tokenizer step {split.get('type')!r} is not a Split")
        pattern = (split.get("pattern") or {}).get("Regex")
        if pattern is None:
            raise NotEligible("Split pre-tokenizer pattern is not a Regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise NotEligible("Split pre-tokenizer is not behavior=Isolated, invert=false")
        _check_regex_covers_everything(pattern)
        return pattern
    kinds = [s.get("type") for s in steps]
    raise NotEligible(
        f"pre-tokenizer {kinds} is not ByteLevel(use_regex=true, add_prefix_space=false) or "
        "Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false, add_prefix_space=false)]"
    )


# One alternative of a split regex that matches any single character of one class, whatever
# follows: optional atoms, the class (once or repeated), then atoms that may match nothing.
_ATOM = r"(?:\\[^A-Za-z0-9]|\\[rntfvsSdDwW]|\[(?:\\.|[^\]\\])*\]|[^\\\[\]()|*+?{}^$])"
_TOTAL_ALTERNATIVE = re.compile(
    rf"(?:{_ATOM}\?)*(?P<core>\\p\{{L\}}|\\p\{{N\}}|\\s|\[\^(?:\\s|\\p\{{L\}}|\\p\{{N\}}){{3}}\])"
    rf"(?:\+|\{{1,\d*\}})?(?:{_ATOM}[*?])*"
)
_CLASS_NAMES = {r"\p{L}": "L", r"\p{N}": "N", r"\s": "S"}


def _top_level_alternatives(pattern: str) -> list[str]:
    """Split a regex at ``|`` outside groups and character classes.

    Nested classes and a leading literal ``]`` in a class are refused rather than parsed.
    """
    parts, depth, in_class, start, i = [], 0, False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            if c == "[":
                raise NotEligible(f"the split regex has a nested character class: {pattern!r}")
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]" or pattern[i + 1 : i + 3] == "^]":
                raise NotEligible(f"the split regex has a class starting with ']': {pattern!r}")
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _check_regex_covers_everything(pattern: str) -> None:
    """Prove that the split regex matches at every position, so no text falls between matches.

    ``tokenizers`` keeps unmatched text as its own piece while tiktoken drops it. The proof needs
    alternatives that unconditionally match one character of each of \\p{L}, \\p{N}, \\s and
    [^\\s\\p{L}\\p{N}]; these four classes cover every character in any Unicode version.
    """
    if re.search(r"\(\?[a-zA-Z-]*\)", pattern):
        raise NotEligible(f"the split regex sets global flags: {pattern!r}")
    covered: set[str] = set()
    for alternative in _top_level_alternatives(pattern):
        m = _TOTAL_ALTERNATIVE.fullmatch(alternative)
        if m is None:
            continue
        core = m.group("core")
        if core in _CLASS_NAMES:
            covered.add(_CLASS_NAMES[core])
        elif all(part in core for part in (r"\s", r"\p{L}", r"\p{N}")):
            covered.add("other")
    missing = {"L", "N", "S", "other"} - covered
    if missing:
        raise NotEligible(
            f"cannot prove the split regex matches every character (no unconditional "
            f"alternative for {sorted(missing)}): {pattern!r}"
        )


def _check_added_tokens(hf: Any, forms: tuple[str, ...]) -> tuple[_AddedToken, ...]:
    """Collect added tokens as ``tokenizers`` loaded them; refuse options we do not reproduce."""
    added = []
    for token_id, tok in sorted(hf.get_added_tokens_decoder().items()):
        name = repr(tok.content)
        if tok.lstrip or tok.rstrip or tok.single_word:
            raise NotEligible(f"added token {name} uses lstrip/rstrip/single_word")
        if tok.normalized and forms:
            raise NotEligible(f"added token {name} is normalized=true while a normalizer is set")
        if not tok.content:
            raise NotEligible("an added token is empty")
        added.append(_AddedToken(tok.content, token_id, bool(tok.normalized)))
    return tuple(added)


def _native_specials_ok(added: tuple[_AddedToken, ...], forms: tuple[str, ...]) -> bool:
    """Whether tiktoken's special-token matching equals ``tokenizers``' added-token matching.

    tiktoken matches with a leftmost-first alternation in arbitrary order, ``tokenizers`` with a
    leftmost-longest search, in one pass per ``normalized`` flag. They agree when there is one
    pass, no normalizer, and no token is a prefix of another.
    """
    if forms or len({t.normalized for t in added}) > 1:
        return False
    contents = sorted(t.content for t in added)
    return not any(b.startswith(a) for a, b in zip(contents, contents[1:]))


# ---------------------------------------------------------------------------------------------
# Merge analysis: derive tiktoken ranks whose merge order provably equals tokenizers' order


def _merge_results(raw: list[Any]) -> list[str]:
    """The token each merge produces; merges are "a b" strings or [a, b] pairs.

    ``tokenizers`` has already checked, on loading, that both parts are in the vocabulary.
    Byte-level tokens contain no literal space, so dropping the separator joins the parts.
    """
    if raw and isinstance(raw[0], str):
        return [item.replace(" ", "") for item in raw]
    return [a + b for a, b in raw]


def _merge_groups(results: list[str], vocab: dict[str, int]) -> dict[str, int]:
    """(A) Number merge results in list order, requiring each result's merges be contiguous.

    Then ranking tokens by group orders any two merges with different results as the merge list
    does. (Duplicate merges are harmless when contiguous, and otherwise fail this check.)
    """
    group: dict[str, int] = {}
    previous = None
    for result in results:
        if result != previous:
            if result in group:
                raise NotEligible(
                    f"(A) merges producing {result!r} are not contiguous in the merge list"
                )
            if result not in vocab:
                raise NotEligible(f"merge result {result!r} is not in the vocabulary")
            group[result] = len(group)
            previous = result
    return group


def _check_pairs_agree(hf: Any, vocab: dict[str, int], spec_ignore_merges: bool) -> list[str]:
    """(B) No vocab token's BPE may stop at two parts; return the tokens BPE cannot form.

    Runs ``tokenizers``' merge loop (ignore_merges off) on every multi-byte vocab token. A result
    of exactly two parts x + y means no merge joins them, while tiktoken, which merges any pair
    whose concatenation is in the vocabulary, would. One part means the token is formed by
    merges; three or more that neither engine ever forms it by merging.
    """
    model = hf.model
    ignore_merges = bool(spec_ignore_merges)
    if ignore_merges and not hasattr(model, "ignore_merges"):
        raise NotEligible("this tokenizers version cannot switch ignore_merges off for check (B)")
    unformable = []
    try:
        if ignore_merges:
            model.ignore_merges = False
        for token in vocab:
            if len(token) < 2:
                continue
            parts = model.tokenize(token)
            if len(parts) == 2:
                x, y = parts[0].value, parts[1].value
                raise NotEligible(
                    f"(B) BPE of {token!r} stops at {x!r} + {y!r}, which no merge joins, but "
                    "tiktoken would join them because the concatenation is in the vocabulary"
                )
            if len(parts) > 2:
                unformable.append(token)
    finally:
        if ignore_merges:
            model.ignore_merges = True
        clear_cache = getattr(model, "_clear_cache", None)
        if clear_cache is not None:
            clear_cache()  # it holds results computed without ignore_merges
    return unformable


def _merge_ranks(
    spec: dict[str, Any], hf: Any
) -> tuple[list[bytes], np.ndarray, np.ndarray | None]:
    """Check (A) and (B); return tiktoken's mergeable tokens, their ranks and rank -> id map.

    Merge-produced tokens are ranked in merge-group order. Other tokens are never formed by
    merging (B), so their ranks only need to be unique. Tokens BPE cannot form are kept when
    ``ignore_merges`` is on (both engines return them as whole pre-tokens) and dropped otherwise
    (so that tiktoken does not return them as whole pre-tokens either).
    """
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    if len(set(vocab.values())) != len(vocab):
        raise NotEligible("vocabulary ids are not unique")
    as_bytes = {token: _token_bytes(token) for token in vocab}
    missing = [c for c in _ALPHABET if c not in vocab]
    if missing:
        raise NotEligible(f"{len(missing)} single bytes are missing from the vocabulary")
    group = _merge_groups(_merge_results(model["merges"]), vocab)
    unformable = _check_pairs_agree(hf, vocab, bool(model.get("ignore_merges")))
    keep = list(vocab)
    if not model.get("ignore_merges"):
        dropped = set(unformable)
        keep = [t for t in keep if t not in dropped]

    by_group = sorted(group, key=group.__getitem__)
    group_ids = np.array([vocab[t] for t in by_group], dtype=np.int64)
    if np.all(group_ids[1:] > group_ids[:-1]):
        tokens = [as_bytes[t] for t in keep]
        return tokens, np.array([vocab[t] for t in keep], dtype=np.int64), None
    kept = set(keep)
    rest = [t for t in keep if t not in group]
    ordered = [t for t in by_group if t in kept] + rest
    ranks = np.arange(len(ordered), dtype=np.int64)
    return [as_bytes[t] for t in ordered], ranks, np.array([vocab[t] for t in ordered])


# ---------------------------------------------------------------------------------------------
# Load-time self-check


def _self_check_texts(added: tuple[_AddedToken, ...]) -> list[str]:
    """Tricky strings both engines must encode alike (guards against conditions we missed)."""
    texts = [
        "",
        " ",
        "Hello, world! DON'T you're WE'LL it'S I'd they've I'M 'll'RE",
        "x'ſt y'ﬆz 'K' 'İ'",
        "日本語のテキスト、中文文本。한국어 텍스트",
        "emoji 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇩🇪🇫🇷",
        "combining: e\u0301 a\u0308\u0304 Z\u0335\u0321\u0354 ñ vs n\u0303",
        "RTL: שלום עולם مرحبا بالعالم \u200f\u202eabc\u202c",
        "tabs\t\tand\t newlines\n\n\r\n\r\n  \n\t \u3000\u00a0\u2009 \u200b\ufeff end",
        "digits 1 12 123 1234 12345 3.14159 1e-10 ٣٤٥ ½ ⅷ 0x1F",
        "code:\n    def f(x):\n        return x  # comment\n\n\n\tpass\r\n",
        "\u0085\u2028\u2029\u180e\x0b\x0c\x1c\x1f",
        "Garay 𐵐𐵑 Kirat 𖵀𖵁 Todhri 𐗀 Kawi 𑼄𑼅 Ext-I 𮯰 new 𐥀 𑶰 𖺠 𲎰",
    ]
    texts += ["=" * n + " " * n + "=" for n in range(1, 41)]
    texts += [" " * n + "x" for n in range(1, 41)] + ["\n" * n + " " for n in (1, 2, 3, 7)]
    texts += ["a" + "\t \n" * 9 + "b", "-" * 100, "a" * 300 + "b" * 5, "ab" * 200]
    for tok in added[:16]:
        texts.append(f"x{tok.content}y {tok.content}{tok.content} {tok.content[:-1]}")
    return texts


def _split_probe_texts() -> list[str]:
    """Short strings whose pre-token boundaries are compared between the two regex engines."""
    chars = [*"aZſéß日한اא1٣½Ⅷ𐵐𖵀𐗀𑼄𮯰'!-=_.", "\u0301", "\u200d", "👍", *"\t\n\r\x0b\x0c"]
    chars += [*"\u0085\u00a0\u1680\u2000\u2009\u200b\u2028\u202f\u3000\ufeff\u180e"]
    probes = ["".join(p) for p in (("x", c, "y") for c in chars)]
    probes += [f"{c}{c} {c}1{c}!{c}\n" for c in chars]
    probes += ["x'ſt", "'S'T'RE", "x'ﬆ", " \n\n ", "  \r\n\t x", "a\n\nb", "12345 67", "'ll've"]
    return probes


def _pieces_by_tiktoken(pattern: str, texts: list[str]) -> list[list[bytes]]:
    """Return tiktoken's pre-token pieces by giving it a vocabulary holding every substring."""
    import tiktoken

    vocab = {bytes([b]) for b in range(256)}
    for text in texts:
        raw = text.encode()
        vocab.update(raw[i:j] for i in range(len(raw)) for j in range(i + 1, len(raw) + 1))
    ranks = {tok: i for i, tok in enumerate(sorted(vocab))}
    enc = tiktoken.Encoding("probe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [[enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(s)] for s in texts]


def _self_check(fast: FastBPE, hf: Any, plan: _Plan) -> None:
    """Compare both engines' pre-token pieces and ids on tricky text; NotEligible if they differ."""
    probes = [fast._normalize(p) for p in _split_probe_texts()]
    try:
        ours = _pieces_by_tiktoken(plan.pattern, probes)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a Rust panic surfaces as PanicException (a BaseException)
        raise NotEligible(f"tiktoken failed on the split regex: {e}") from None
    for probe, pieces in zip(probes, ours):
        theirs = [_token_bytes(p) for p, _ in hf.pre_tokenizer.pre_tokenize_str(probe)]
        if theirs != pieces:
            raise NotEligible(f"split regex differs between engines on {probe!r}")
    texts = _self_check_texts(plan.added)
    expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    for text, want in zip(texts, expected):
        try:
            got = fast.encode(text)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise NotEligible(f"self-check: tiktoken failed on {text[:40]!r}: {e}") from None
        if got != want:
            raise NotEligible(f"self-check: ids differ from tokenizers on {text[:40]!r}")


# ---------------------------------------------------------------------------------------------
# The engine


class FastBPE:
    """Byte-level BPE encoder on tiktoken, with ids identical to ``tokenizers``.

    Build with :meth:`from_tokenizer_json`. Instances are picklable: the pickle holds the derived
    ranks, and unpickling rebuilds the tiktoken object without repeating the checks.
    """

    def __init__(self, plan: _Plan) -> None:
        """Build the tiktoken engine from an already-verified plan (use from_tokenizer_json)."""
        import tiktoken

        self._plan = plan
        ranks = dict(zip(plan.tokens, plan.ranks.tolist()))
        self._enc = tiktoken.Encoding(
            "fast_bpe", pat_str=plan.pattern, mergeable_ranks=ranks, special_tokens=plan.specials
        )
        # The core's encode raises on lone surrogates as tokenizers does, where tiktoken's
        # wrapper would silently replace them.
        self._core = self._enc._core_bpe
        self._allowed = set(plan.specials)
        self._map = plan.rank_to_id
        self._normalizers = _build_normalizers(plan.normalizers)
        self._splitters = None
        if not plan.native_specials:
            self._splitters = _build_added_splitters(plan.added, plan.specials)

    @classmethod
    def from_tokenizer_json(cls, text: str) -> FastBPE:
        """Build from the JSON text of a tokenizer.json; NotEligible if ids could differ."""
        with _gc_paused():
            return cls._build(text)

    @classmethod
    def _build(cls, text: str) -> FastBPE:
        """Body of from_tokenizer_json."""
        from tokenizers import Tokenizer

        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise NotEligible(f"not valid JSON: {e}") from None
        _check_options(spec)
        forms = _check_normalizer(spec.get("normalizer"))
        pattern = _check_pre_tokenizer(spec.get("pre_tokenizer"))
        try:
            hf = Tokenizer.from_str(text)
        except Exception as e:
            raise NotEligible(f"tokenizers cannot load it: {e}") from None
        added = _check_added_tokens(hf, forms)
        tokens, ranks, rank_to_id = _merge_ranks(spec, hf)
        specials = _special_ids(added, rank_to_id)
        if rank_to_id is not None:
            extra = np.array([t.id for t in added], dtype=rank_to_id.dtype)
            rank_to_id = np.concatenate([rank_to_id, extra])
        plan = _Plan(
            pattern=pattern,
            tokens=tokens,
            ranks=ranks,
            specials=specials,
            rank_to_id=rank_to_id,
            normalizers=forms,
            added=added,
            native_specials=_native_specials_ok(added, forms),
        )
        try:
            fast = cls(plan)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # bad regex syntax for fancy-regex, Rust panics
            raise NotEligible(f"tiktoken cannot build this tokenizer: {e}") from None
        _self_check(fast, hf, plan)
        return fast

    def __reduce__(self) -> tuple[Any, tuple[_Plan]]:
        """Pickle the verified plan; unpickling rebuilds the Rust object."""
        return (type(self), (self._plan,))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, equal to tokenizers' ``encode(text, add_special_tokens=False).ids``."""
        if self._splitters is not None:
            ids = []
            for piece, token_id in self._split_added(text):
                if token_id is not None:
                    ids.append(token_id)
                else:
                    ids.extend(self._core.encode_ordinary(piece))
        elif self._allowed:
            ids = self._core.encode(text, self._allowed)
        else:  # tiktoken's special-token search misbehaves when there are none
            ids = self._core.encode_ordinary(text)
        if self._map is not None and ids:
            return self._map[np.asarray(ids)].tolist()
        return ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Encode several texts, one after another (callers parallelize with processes)."""
        return [self.encode(t) for t in texts]

    def _normalize(self, text: str) -> str:
        """Apply the tokenizer's Unicode normalizers, with tokenizers' own implementation."""
        for normalizer in self._normalizers:
            text = normalizer.normalize_str(text)
        return text

    def _split_added(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Split out added tokens like tokenizers: raw-text tokens first, then normalized ones.

        Yields (normalized text piece, None) for ordinary text and (content, id) for added
        tokens.
        """
        raw, normalized = self._splitters
        for piece, token_id in _split_on(raw, text):
            if token_id is not None:
                yield piece, token_id
            else:
                yield from _split_on(normalized, self._normalize(piece))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector; it would rescan the vocabulary's many small objects."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _special_ids(added: tuple[_AddedToken, ...], rank_to_id: np.ndarray | None) -> dict[str, int]:
    """Ids tiktoken emits for added tokens: the HF id, or a rank past the mergeable ones."""
    if rank_to_id is None:
        return {t.content: t.id for t in added}
    return {t.content: len(rank_to_id) + i for i, t in enumerate(added)}


def _build_normalizers(forms: tuple[str, ...]) -> list[Any]:
    """Instantiate ``tokenizers`` normalizers (not unicodedata, whose Unicode version may lag)."""
    if not forms:
        return []
    from tokenizers import normalizers

    return [getattr(normalizers, form)() for form in forms]


_Splitter = tuple[re.Pattern[str], dict[str, int]] | None


def _build_added_splitters(
    added: tuple[_AddedToken, ...], specials: dict[str, int]
) -> tuple[_Splitter, _Splitter]:
    """Longest-first regexes for the raw-text and the normalized-text added-token passes."""

    def build(contents: list[str]) -> _Splitter:
        if not contents:
            return None
        ordered = sorted(contents, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(c) for c in ordered))
        return pattern, {c: specials[c] for c in contents}

    return (
        build([t.content for t in added if not t.normalized]),
        build([t.content for t in added if t.normalized]),
    )


def _split_on(splitter: _Splitter, text: str) -> Iterator[tuple[str, int | None]]:
    """Split ``text`` at leftmost-longest added-token matches (alternatives are longest-first)."""
    if splitter is None:
        if text:
            yield text, None
        return
    pattern, ids = splitter
    start = 0
    for m in pattern.finditer(text):
        if m.start() > start:
            yield text[start : m.start()], None
        yield m.group(), ids[m.group()]
        start = m.end()
    if start < len(text):
        yield text[start:], None
