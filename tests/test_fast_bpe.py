"""FastBPE must give exactly tokenizers' ids, or refuse (NotEligible) with a reason."""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from pipeline.preprocess import fast_bpe  # noqa: E402
from pipeline.preprocess.fast_bpe import FastBPE, NotEligible  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared/data"
LLAMA3 = SHARED / "tokenizers/llama3/tokenizer.json"
LLAMA2 = SHARED / "tokenizers/llama2/tokenizer.json"
CORPUS = SHARED / "corpus/python_docs.jsonl.zst"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Character classes mixed into random test strings.
CLASSES = [
    "abcxyzABCXYZ",
    "0123456789",
    " ",
    "\t\n\r\u3000\u00a0\u2009\x0b\x0c\u0085\u2028",
    ".,;:!?-_=+*/\\|'\"()[]{}<>#@$%^&~`",
    "日本語中文字한국어テスト",
    "שלוםعالم",
    "\u0301\u0308\u0327\u20e3",
    "😀👍🏽👨\u200d👩\u200d👧🏳\ufe0f\u200d🌈❤\ufe0f\u200d🔥🇩🇪",
    "ſßéÅİıﬁ½Ⅷ٣",
]
WORDS = ["'s", "'T", "'re", "'VE", "'m", "'LL", "'d", "DON'T", "we'll", "=====", "    ", "\r\n"]


# --------------------------------------------------------------------------------------------
# Helpers and fixtures


def hf_ids(tok_json: str, texts: list[str]) -> list[list[int]]:
    """Reference ids from tokenizers itself."""
    tok = Tokenizer.from_str(tok_json)
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def assert_same(fast: FastBPE, tok_json: str, texts: list[str]) -> None:
    """FastBPE ids equal tokenizers' ids on every text (first mismatch reported)."""
    want = hf_ids(tok_json, texts)
    got = fast.encode_batch(texts)
    for text, a, b in zip(texts, want, got):
        assert b == a, f"mismatch on {text[:80]!r}"


def random_texts(n: int, seed: int, extra: list[str] = ()) -> list[str]:
    """Seeded random mixes of the character classes, contractions and runs."""
    rng = random.Random(seed)
    pool = [*WORDS, *extra]
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            if r < 0.15:
                parts.append(rng.choice(pool))
            elif r < 0.25:
                parts.append(rng.choice(" \t\n=-") * rng.randint(1, 40))
            else:
                cls = rng.choice(CLASSES)
                parts.append("".join(rng.choice(cls) for _ in range(rng.randint(1, 8))))
        texts.append("".join(parts))
    return texts


def varied_texts(specials: list[str]) -> list[str]:
    """Hand-written hard cases, plus literal special-token strings inside text."""
    texts = [
        "",
        " ",
        "Hello, world! I'm here; DON'T PANIC. They'RE 'll've",
        "日本語のテキストと中文混合 text 한국어",
        "emoji: 👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳\ufe0f\u200d🌈 ❤\ufe0f\u200d🔥 🇫🇷🇩🇪 1\ufe0f\u20e3",
        "e\u0301 a\u0308\u0304 Z\u0335\u0321 ñ n\u0303 \u0301start",
        "RTL: שלום עולם مرحبا بالعالم \u200f\u202eabc\u202c",
        "ws \t\t\n\n\r\n\r\n   \n\t \u3000\u00a0 x" + " " * 100 + "\n" * 30 + "\t" * 17 + "y",
        "digits 1 12 123 1234 12345678901234567890 3.14 ٣٤٥ ½",
        "def f(x):\n    return x  # comment\n\n\n\tpass\r\n" * 3,
        "=" * 50 + " " * 33 + "-" * 7 + "\n",
        "a" * 5000 + "b" * 3 + "ab" * 1000,
    ]
    for s in specials:
        texts += [f"before{s}after", f"{s}{s} {s}\n{s}", f"x {s[:-1]} {s[1:]} {s.upper()}"]
    return texts


def load_corpus() -> list[str]:
    """The 497 documents of the real corpus (zstd JSONL)."""
    zstandard = pytest.importorskip("zstandard")
    if not CORPUS.exists():
        pytest.skip(f"corpus not found at {CORPUS}")
    with CORPUS.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as raw:
        return [json.loads(line)["text"] for line in io.TextIOWrapper(raw, encoding="utf-8")]


def generated_corpus(seed: int = 0, size: int = 300_000) -> list[str]:
    """A few hundred KB of generated text with words, code, numbers and other scripts."""
    rng = random.Random(seed)
    syllables = ["the", "an", "ing", "er", "qu", "ion", "st", "ea", "ou", "th", "re", "in"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["日本", "語", "中文", "한국어", "שלום", "مرحبا", "éte", "naïve", "👍", "😀"]
    lines, total = [], 0
    while total < size:
        n = rng.randint(3, 15)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line = line.capitalize() + rng.choice([".", "!", "?", ",", ":", ";"])
        if rng.random() < 0.2:
            line = "    " + line + " = " + str(rng.randint(0, 10**6))
        if rng.random() < 0.1:
            line += " DON'T they're we'll I'M it's"
        lines.append(line)
        total += len(line)
    return ["\n".join(lines[i : i + 20]) for i in range(0, len(lines), 20)]


def train_bpe(pre_tokenizer, *, special=("<|endoftext|>",), normalizer=None) -> str:
    """Train a byte-level BPE with tokenizers and return its tokenizer.json text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(), trainer)
    return tok.to_str()


def gpt2_pre() -> pre_tokenizers.PreTokenizer:
    """GPT-2's pre-tokenizer: ByteLevel with its built-in regex."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def llama3_pre() -> pre_tokenizers.PreTokenizer:
    """Llama 3's pre-tokenizer: its Split regex, then ByteLevel without a regex."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def edit(tok_json: str, fn) -> str:
    """Return tok_json after applying fn to its parsed dict."""
    spec = json.loads(tok_json)
    fn(spec)
    return json.dumps(spec)


@pytest.fixture(scope="module")
def llama3() -> tuple[str, FastBPE]:
    if not LLAMA3.exists():
        pytest.skip(f"Llama 3 tokenizer not found at {LLAMA3}")
    text = LLAMA3.read_text(encoding="utf-8")
    return text, FastBPE.from_tokenizer_json(text)


@pytest.fixture(scope="module")
def gpt2_json() -> str:
    return train_bpe(gpt2_pre())


@pytest.fixture(scope="module")
def split_json() -> str:
    return train_bpe(llama3_pre(), special=("<|endoftext|>", "<|pad|>", "<|im_start|>"))


# --------------------------------------------------------------------------------------------
# Llama 3 (the real file)


def test_llama3_identical_on_corpus(llama3):
    text, fast = llama3
    assert_same(fast, text, load_corpus())


def test_llama3_identical_on_varied_text(llama3):
    text, fast = llama3
    specials = ["<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
    texts = varied_texts(specials)
    huge = "\n\n".join(texts + random_texts(200, seed=5))
    texts.append((huge * (1_000_000 // len(huge) + 1))[:1_000_000])
    assert_same(fast, text, texts)
    assert fast.encode("<|begin_of_text|>") == [128000]


def test_llama3_identical_on_random_strings(llama3):
    text, fast = llama3
    assert_same(fast, text, random_texts(3000, seed=1, extra=["<|end_of_text|>", "<|eot_id|>"]))


def test_llama3_has_merges_whose_parts_rank_later(llama3):
    """Llama 3 breaks the textbook 'parts before result' rule; it must still be accepted."""
    text, _ = llama3
    merges = [m.split(" ") for m in json.loads(text)["model"]["merges"]]
    formed_at: dict[str, int] = {}
    for i, (a, b) in enumerate(merges):
        formed_at.setdefault(a + b, i)
    late = [(a, b) for i, (a, b) in enumerate(merges) if formed_at.get(b, -1) > i]
    assert ("Ġ", "ĠĠĠ") in late


def test_pickle_round_trip(llama3):
    text, fast = llama3
    clone = pickle.loads(pickle.dumps(fast))
    sample = varied_texts(["<|end_of_text|>"]) + random_texts(200, seed=2)
    assert clone.encode_batch(sample) == fast.encode_batch(sample)


# --------------------------------------------------------------------------------------------
# Refusals of whole tokenizer families


def test_llama2_refused():
    if not LLAMA2.exists():
        pytest.skip(f"Llama 2 tokenizer not found at {LLAMA2}")
    with pytest.raises(NotEligible, match="byte_fallback"):
        FastBPE.from_tokenizer_json(LLAMA2.read_text(encoding="utf-8"))


def test_metaspace_refused():
    tok_json = train_bpe(pre_tokenizers.Metaspace())
    with pytest.raises(NotEligible, match="pre-tokenizer"):
        FastBPE.from_tokenizer_json(tok_json)


def test_sentencepiece_style_normalizer_refused(gpt2_json):
    def sp_style(spec):
        spec["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        }

    with pytest.raises(NotEligible, match="normalizer 'Prepend'"):
        FastBPE.from_tokenizer_json(edit(gpt2_json, sp_style))


def test_digits_pre_tokenizer_refused(gpt2_json):
    def digits(spec):
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]],
        }

    with pytest.raises(NotEligible, match="pre-tokenizer"):
        FastBPE.from_tokenizer_json(edit(gpt2_json, digits))


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s: s["model"].update(dropout=0.1), "dropout"),
        (lambda s: s["model"].update(continuing_subword_prefix="##"), "continuing_subword_prefix"),
        (lambda s: s["model"].update(end_of_word_suffix="</w>"), "end_of_word_suffix"),
        (
            lambda s: s.update(
                truncation={
                    "max_length": 8,
                    "strategy": "LongestFirst",
                    "stride": 0,
                    "direction": "Right",
                }
            ),
            "truncation",
        ),
        (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
    ],
)
def test_options_refused(gpt2_json, change, reason):
    with pytest.raises(NotEligible, match=reason):
        FastBPE.from_tokenizer_json(edit(gpt2_json, change))


# --------------------------------------------------------------------------------------------
# Trained byte-level tokenizers


def test_gpt2_style_accepted_and_identical(gpt2_json):
    fast = FastBPE.from_tokenizer_json(gpt2_json)
    texts = varied_texts(["<|endoftext|>"]) + random_texts(2000, seed=3, extra=["<|endoftext|>"])
    assert_same(fast, gpt2_json, texts + generated_corpus(seed=9, size=50_000))


def test_split_bytelevel_accepted_and_identical(split_json):
    fast = FastBPE.from_tokenizer_json(split_json)
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>"]
    texts = varied_texts(specials) + random_texts(2000, seed=4, extra=specials)
    assert_same(fast, split_json, texts + generated_corpus(seed=8, size=50_000))


def test_ids_out_of_merge_order_are_mapped(gpt2_json):
    """When HF ids do not follow merge order, tiktoken ranks are mapped back to HF ids."""

    def permute_ids(spec):
        vocab = spec["model"]["vocab"]
        merged = ["".join(m) for m in spec["model"]["merges"]]
        ids = [vocab[t] for t in merged]
        random.Random(0).shuffle(ids)
        vocab.update(zip(merged, ids))

    tok_json = edit(gpt2_json, permute_ids)
    fast = FastBPE.from_tokenizer_json(tok_json)
    assert fast._map is not None
    texts = varied_texts(["<|endoftext|>"]) + random_texts(1000, seed=13, extra=["<|endoftext|>"])
    assert_same(fast, tok_json, texts)


def test_ignore_merges_variant_identical(gpt2_json):
    tok_json = edit(gpt2_json, lambda s: s["model"].update(ignore_merges=True))
    fast = FastBPE.from_tokenizer_json(tok_json)
    assert_same(fast, tok_json, random_texts(1000, seed=6))


def test_all_splits_merges_identical(gpt2_json):
    """Llama-3-style merge lists (every split of a token, in shuffled order within a token)."""
    rng = random.Random(0)

    def all_splits(spec):
        vocab = spec["model"]["vocab"]
        merges = []
        for token in sorted(vocab, key=vocab.get):
            local = [[token[:i], token[i:]] for i in range(1, len(token))]
            local = [m for m in local if m[0] in vocab and m[1] in vocab]
            rng.shuffle(local)
            merges += local
        spec["model"]["merges"] = merges
        spec["model"]["ignore_merges"] = True

    tok_json = edit(gpt2_json, all_splits)
    fast = FastBPE.from_tokenizer_json(tok_json)
    assert_same(fast, tok_json, random_texts(1500, seed=7) + generated_corpus(seed=3, size=30_000))


# --------------------------------------------------------------------------------------------
# Merge-order conditions: each test fails if its check were removed


def test_non_contiguous_merges_refused(gpt2_json):
    """(A) Two merges producing one token, with another merge between them."""

    def split_group(spec):
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        for a, b in merges:
            if len(a) >= 2:  # add a second way to build a+b, at the end of the list
                alt = [a[:-1], a[-1] + b]
                if alt[0] in vocab and alt[1] in vocab and alt not in merges:
                    merges.append(alt)
                    return
        raise AssertionError("no candidate merge found")

    with pytest.raises(NotEligible, match=r"\(A\)"):
        FastBPE.from_tokenizer_json(edit(gpt2_json, split_group))


def test_reordered_merges_refused_or_identical(gpt2_json):
    """Moving merges after the merges that use their result: refused, or still identical."""
    spec = json.loads(gpt2_json)
    merges = spec["model"]["merges"]
    first_use: dict[str, int] = {}
    for k, (a, b) in enumerate(merges):
        first_use.setdefault(a, k)
        first_use.setdefault(b, k)
    used = [i for i, m in enumerate(merges) if "".join(m) in first_use]
    outcomes = []
    for i in used[:: len(used) // 4][:4]:
        user = first_use["".join(merges[i])]
        moved = merges[:i] + merges[i + 1 : user + 1] + [merges[i]] + merges[user + 1 :]
        spec["model"]["merges"] = moved
        tok_json = json.dumps(spec)
        try:
            fast = FastBPE.from_tokenizer_json(tok_json)
        except NotEligible as e:
            assert "(A)" in str(e) or "(B)" in str(e)
            outcomes.append("refused")
        else:
            assert_same(fast, tok_json, random_texts(500, seed=i) + generated_corpus(i, 20_000))
            outcomes.append("identical")
    assert len(outcomes) == 4


def test_token_joinable_without_merge_refused(gpt2_json):
    """(B) A vocab token made of two tokens with no merge: tiktoken would join them."""

    def add_token(spec):
        vocab = spec["model"]["vocab"]
        assert "qz" not in vocab  # 'z' never occurs in the training text
        vocab["qz"] = max(vocab.values()) + 1

    with pytest.raises(NotEligible, match=r"\(B\)"):
        FastBPE.from_tokenizer_json(edit(gpt2_json, add_token))


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_unreachable_token_handled(gpt2_json, ignore_merges):
    """(D) A token merging cannot form: dropped without ignore_merges, kept with it."""
    token = "qzq"  # one pre-token; no split into two vocabulary tokens

    def add_token(spec):
        vocab = spec["model"]["vocab"]
        assert "qz" not in vocab and "zq" not in vocab
        vocab[token] = max(vocab.values()) + 1
        spec["model"]["ignore_merges"] = ignore_merges

    tok_json = edit(gpt2_json, add_token)
    fast = FastBPE.from_tokenizer_json(tok_json)
    assert_same(fast, tok_json, ["qzq", " qzq", "aqzqb", "qzq qzq", "qzqzq"])
    assert (len(fast.encode("qzq")) == 1) == ignore_merges


# --------------------------------------------------------------------------------------------
# Pre-tokenizer regex


def test_regex_without_full_coverage_refused(split_json):
    def narrow(spec):
        spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r" ?\p{L}+| ?\p{N}+"

    with pytest.raises(NotEligible, match="every character"):
        FastBPE.from_tokenizer_json(edit(split_json, narrow))


def test_regex_with_global_flags_refused(split_json):
    def flagged(spec):
        pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]
        pattern["Regex"] = "(?x)" + pattern["Regex"]

    with pytest.raises(NotEligible, match="global flags"):
        FastBPE.from_tokenizer_json(edit(split_json, flagged))


@pytest.mark.parametrize("cls", [r"\p{L}", r"\p{N}", r"\s"])
def test_unicode_classes_agree_between_regex_engines(cls):
    """tiktoken (fancy-regex) and tokenizers (Oniguruma) classify code points alike.

    Every code point of planes 0-1 and a sample of the others is put after a character of the
    class; the pair is one pre-token exactly when the code point is in the class.
    """
    import tiktoken

    lead = {r"\p{L}": "x", r"\p{N}": "1", r"\s": " "}[cls]
    points = [*range(0x20000), *range(0x20000, 0x110000, 97)]
    chars = [chr(c) for c in points if not 0xD800 <= c < 0xE000]
    pattern = f"{cls}+|[^{cls}]"
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({(lead + c).encode(): 256 + i for i, c in enumerate(chars)})
    enc = tiktoken.Encoding("probe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    text = "\x00".join(lead + c for c in chars)
    ours = {chars[t - 256] for t in enc.encode_ordinary(text) if t >= 256}
    pieces = pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)
    theirs = {p[1:] for p, _ in pieces if len(p) > 1 and p[0] == lead}
    assert len(theirs) > 20 and ours == theirs, sorted(ours ^ theirs)[:20]


# --------------------------------------------------------------------------------------------
# Normalizers and added tokens


def test_nfkc_normalizer_identical():
    tok_json = train_bpe(gpt2_pre(), normalizer=normalizers.NFKC())
    fast = FastBPE.from_tokenizer_json(tok_json)
    texts = ["ﬁne ｆｕｌｌ ｗｉｄｔｈ ①②③ Å Å e\u0301 ㎞ ½", "<|endoftext|>ﬁ<|endoftext|>"]
    assert_same(fast, tok_json, texts + random_texts(500, seed=11, extra=["<|endoftext|>"]))


def test_lowercase_normalizer_refused(gpt2_json):
    with pytest.raises(NotEligible, match="Lowercase"):
        FastBPE.from_tokenizer_json(
            edit(gpt2_json, lambda s: s.update(normalizer={"type": "Lowercase"}))
        )


def test_normalized_added_token_with_normalizer_refused():
    tok = Tokenizer.from_str(train_bpe(gpt2_pre(), normalizer=normalizers.NFC()))
    tok.add_tokens([AddedToken("<tool>", normalized=True)])
    with pytest.raises(NotEligible, match="normalized=true"):
        FastBPE.from_tokenizer_json(tok.to_str())


def test_added_tokens_overlapping_and_non_special(gpt2_json):
    """Prefix-overlapping and normalized (non-special) added tokens use the exact splitter."""
    tok = Tokenizer.from_str(gpt2_json)
    tok.add_special_tokens(["<x>", "<x>y", "ab"])
    tok.add_tokens(["xa", "hello world", "ünï"])
    tok_json = tok.to_str()
    fast = FastBPE.from_tokenizer_json(tok_json)
    assert fast._splitters is not None  # tiktoken's own special matching would not be exact
    texts = ["a<x>yb<x>c<x>y<x>", "xab xa ab", "say hello world!", "<x>y<x>yy ünïcode"]
    extra = ["<x>", "<x>y", "ab", "xa", "hello world", "ünï"]
    assert_same(fast, tok_json, texts + random_texts(500, seed=12, extra=extra))


def test_added_token_lstrip_refused(gpt2_json):
    tok = Tokenizer.from_str(gpt2_json)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    with pytest.raises(NotEligible, match="lstrip"):
        FastBPE.from_tokenizer_json(tok.to_str())


def test_self_check_detects_a_different_tokenizer(gpt2_json, split_json):
    """The load-time self-check refuses an engine that disagrees with tokenizers."""
    fast = FastBPE.from_tokenizer_json(gpt2_json)
    other = Tokenizer.from_str(split_json)
    with pytest.raises(NotEligible, match="differ"):
        fast_bpe._self_check(fast, other, fast._plan)
