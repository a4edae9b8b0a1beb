"""Blends: parsing, per-dataset sizes, blending indices equal to megatron-core's C++ helpers (and
to a plain reference loop), and built datasets equal, sample by sample, to megatron-core 0.16.1's
`BlendedMegatronDatasetBuilder` output; plus every refusal."""

from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest

from pipeline.data import blended, blending_indices
from pipeline.data.blend_description import describe_blend, format_blend_description
from pipeline.data.blend_spec import (
    Blend,
    MockData,
    PerSplitBlend,
    parse_blend,
    parse_per_split_blend,
    read_blend_file,
    read_per_split_blend_file,
)
from pipeline.data.blended import (
    BlendedDataset,
    build_datasets,
    normalize_weights,
    samples_per_dataset,
)
from pipeline.data.blending_indices import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from pipeline.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from pipeline.data.indexed import IndexedDatasetWriter
from tests.builders import quiet_megatron

VOCAB, EOD, PAD = 1000, 0, 1

# ----------------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's builder pieces and C++ helpers, imported quietly, or skip."""
    with quiet_megatron():
        from megatron.core.datasets import blended_megatron_dataset_builder as builder
        from megatron.core.datasets import gpt_dataset, helpers_cpp, utils

    class Namespace:
        pass

    ns = Namespace()
    ns.builder, ns.gpt, ns.helpers, ns.utils = builder, gpt_dataset, helpers_cpp, utils
    return ns


class StubTokenizer:
    """What megatron-core's datasets read from a tokenizer."""

    vocab_size, eod, pad = VOCAB, EOD, PAD
    unique_identifiers = {"class": "StubTokenizer"}


def megatron_build(m, sizes, *, blend=None, per_split=None, split=None, cache=None, **kw):
    config = m.gpt.GPTDatasetConfig(
        random_seed=kw.get("seed", 1234),
        sequence_length=kw.get("seq", 32),
        blend=blend,
        blend_per_split=per_split,
        split=split,
        path_to_cache=cache,
        tokenizer=StubTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=kw.get("extra", True),
        mid_level_dataset_surplus=kw.get("surplus", 0.005),
    )
    return m.builder.BlendedMegatronDatasetBuilder(
        m.gpt.GPTDataset, list(sizes), lambda: True, config
    ).build()


def our_config(split: str | None, cache=None, **kw) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=kw.get("seed", 1234),
        sequence_length=kw.get("seq", 32),
        eod_id=EOD,
        pad_id=PAD,
        tokenizer_id="StubTokenizer",
        split=split,
        path_to_cache=None if cache is None else str(cache),
        add_extra_token_to_sequence=kw.get("extra", True),
    )


def assert_same(ours: list, theirs: list) -> None:
    """Same splits, classes, lengths, blending indices and every sample, in order."""
    assert len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        if t is None:
            assert o is None
            continue
        assert type(o).__name__ == type(t).__name__
        assert len(o) == len(t)
        if isinstance(o, BlendedDataset):
            assert o.weights == pytest.approx(t.weights, abs=0) and o.size == t.size
            for name in ("dataset_index", "dataset_sample_index"):
                a, b = getattr(o, name), getattr(t, name)
                assert a.dtype == b.dtype, name
                np.testing.assert_array_equal(a, b, err_msg=name)
            for a, b in zip(o.datasets, t.datasets):
                assert a.num_samples == b.num_samples
                np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
        for i in range(len(t)):
            a, b = o[i], t[i]
            assert list(a) == list(b)
            for key in a:
                np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), key)


# ----------------------------------------------------------------------------------- data


def write_dataset(prefix, num_sequences: int, seed: int, dtype=np.uint16, max_length=150) -> str:
    """Sequences of 0..max_length tokens ending in EOD, never holding the pad id (megatron-core
    0.16.1 caches the first sample's loss mask after zeroing its pad labels, so a pad token in
    the data would make it, not us, differ between samples)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, num_sequences).astype(np.int32)
    lengths[rng.random(num_sequences) < 0.03] = 0
    tokens = rng.integers(2, VOCAB, int(lengths.sum())).astype(dtype)
    tokens[np.cumsum(lengths)[lengths > 0] - 1] = EOD
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(tokens, lengths, np.ones(num_sequences, np.int64))
        writer.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    """Three datasets of 300, 500 and 800 sequences."""
    directory = tmp_path_factory.mktemp("blend")
    return [
        write_dataset(directory / f"{name}_text_document", n, seed)
        for seed, (name, n) in enumerate([("a", 300), ("b", 500), ("c", 800)])
    ]


# ----------------------------------------------------------------------------------- parsing


def test_parse_weighted_and_unweighted():
    assert parse_blend("0.7 a 0.3 b") == Blend(["a", "b"], [0.7, 0.3])
    assert parse_blend(["30", " a ", "70", "b"]) == Blend(["a", "b"], [30.0, 70.0])
    assert parse_blend("a b c") == Blend(["a", "b", "c"], None)
    assert parse_blend("a b") == Blend(["a", "b"], None)  # even, no weights: all prefixes
    assert parse_blend("  a\n") == Blend(["a"], None)
    assert parse_blend("1e-3 a 2 b").weights == [0.001, 2.0]


def test_parse_agrees_with_megatron(megatron):
    for tokens in (["0.7", "a", "0.3", "b"], ["a", "b", "c"], ["a", "b"], ["2", "x"], ["a"]):
        prefixes, weights = megatron.utils.get_blend_from_list(tokens)
        assert parse_blend(tokens) == Blend(prefixes, weights)


@pytest.mark.parametrize(
    "tokens, culprit",
    [
        ("-0.5 a 1 b", "'-0.5'"),
        ("0 a 1 b", "'0'"),
        ("nan a 1 b", "'nan'"),
        ("1 a inf b", "'inf'"),
        ("0.5 a b c", "'b'"),  # half weights, half not: ambiguous
        ("a 0.5 b 0.5", "'0.5' looks like a weight"),  # prefix first
        ("0.5 a 0.5", "'0.5'"),  # odd count with a number: a weight without its prefix
        ("", "empty"),
    ],
)
def test_parse_refuses(tokens, culprit):
    with pytest.raises(ValueError, match=culprit):
        parse_blend(tokens)


def test_blend_files(tmp_path):
    path = tmp_path / "blend.txt"
    path.write_text("0.25 data/a_text_document\n0.75\tdata/b_text_document\n")
    assert read_blend_file(path) == Blend(
        ["data/a_text_document", "data/b_text_document"], [0.25, 0.75]
    )
    path.write_text("0.25 a -1 b")
    with pytest.raises(ValueError, match=rf"{path}: weight '-1'"):
        read_blend_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_blend_file(tmp_path / "missing.txt")


def test_per_split_blends(tmp_path):
    per_split = parse_per_split_blend(train="0.3 a 0.7 b", valid="c", test=None)
    assert per_split.splits() == [Blend(["a", "b"], [0.3, 0.7]), Blend(["c"]), None]
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": "1 a 3 b", "valid": ["c", "d"], "test": None}))
    assert read_per_split_blend_file(path) == PerSplitBlend(
        Blend(["a", "b"], [1.0, 3.0]), Blend(["c", "d"]), None
    )
    path.write_text(json.dumps({"train": "a", "valid": "b"}))
    with pytest.raises(ValueError, match=r"missing key\(s\) \['test'\]"):
        read_per_split_blend_file(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_per_split_blend_file(path)
    path.write_text(json.dumps({"train": "0 a 1 b", "valid": None, "test": None}))
    with pytest.raises(ValueError, match=r"\[train\]: weight '0'"):
        read_per_split_blend_file(path)
    with pytest.raises(ValueError, match="at least one split"):
        PerSplitBlend(None, None, None)
    with pytest.raises(ValueError, match="--valid-data-path"):
        parse_per_split_blend(train="a", valid="1 x y z")


# ----------------------------------------------------------------------------------- sizes


def test_sizes_per_dataset(megatron):
    assert samples_per_dataset([0.3, 0.7], 8) == ([3, 6], [4, 7])  # blended size 9 > 8
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = normalize_weights(rng.random(rng.integers(1, 6)) + 1e-3)
        sizes = [int(rng.integers(0, 10**7)) for _ in range(3)]
        surplus = float(rng.choice([0.0, 0.005, 0.05, 1.0]))
        get = megatron.builder._get_size_per_split_per_dataset
        assert [
            [samples_per_dataset(weights, s, surplus)[1][d] for s in sizes]
            for d in range(len(weights))
        ] == get(weights, sizes, surplus)
        assert [
            [samples_per_dataset(weights, s)[0][d] for s in sizes] for d in range(len(weights))
        ] == get(weights, sizes)
    assert normalize_weights([1, 3]) == megatron.utils.normalize([1, 3]) == [0.25, 0.75]


# ------------------------------------------------------------------------- blending indices


def reference_loop(weights, size, limits=None):
    """Megatron's greedy blending schedule as a plain loop: the second oracle."""
    counts = [0] * len(weights)
    live = list(range(len(weights)))
    picks, numbers = [], []
    for s in range(size):
        x = float(max(s, 1))
        d = max(live, key=lambda i: (weights[i] * x - counts[i], -i))
        picks.append(d)
        numbers.append(counts[d])
        counts[d] += 1
        if limits is not None and counts[d] == limits[d]:
            live.remove(d)
    return np.array(picks, np.int16), np.array(numbers, np.int64)


def cpp_indices(m, weights, size):
    dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
    m.helpers.build_blending_indices(
        dataset_index, sample_index, np.asarray(weights, np.float64), len(weights), size, False
    )
    return dataset_index, sample_index


def cpp_exhaustive(m, sizes):
    total = int(np.sum(sizes))
    dataset_index, sample_index = np.zeros(total, np.int16), np.zeros(total, np.int64)
    m.helpers.build_exhaustive_blending_indices(
        dataset_index, sample_index, np.asarray(sizes, np.int64), len(sizes)
    )
    return dataset_index, sample_index


def assert_indices_equal(ours, theirs):
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def random_weights(rng, n: int) -> list[float]:
    """Ordinary, extreme, tied and rational weight vectors."""
    kind = rng.integers(0, 5)
    if kind == 0:
        raw = rng.dirichlet(np.ones(n))
    elif kind == 1:
        raw = rng.random(n) ** 6 + 1e-7  # some datasets almost never drawn
    elif kind == 2:
        raw = rng.integers(1, 4, n).astype(float)  # many exact ties
    elif kind == 3:
        raw = np.ones(n)
    else:
        raw = rng.choice([0.1, 0.2, 0.3, 0.25, 1 / 3], n)
    return normalize_weights(raw)


def test_blending_indices_small_against_both_oracles(megatron):
    rng = np.random.default_rng(1)
    for size in [0, 1, 2, 3, 17, 200, 1500, 4000]:
        for n in (1, 2, 3, 5):
            weights = random_weights(rng, n)
            ours = build_blending_indices(weights, size)
            assert_indices_equal(ours, cpp_indices(megatron, weights, size))
            if size <= 1500:
                assert_indices_equal(ours, reference_loop(weights, size))


def test_blending_indices_large_random_weights(megatron):
    """Sizes up to millions, 2 to 40 datasets, ordinary to pathological weights."""
    rng = np.random.default_rng(2)
    cases = [(n, size) for n in (2, 3, 4, 7, 12, 40) for size in (5_000, 123_457)]
    cases += [(2, 3_000_000), (3, 2_000_001), (10, 1_000_000)]
    for n, size in cases:
        weights = random_weights(rng, n)
        assert_indices_equal(
            build_blending_indices(weights, size), cpp_indices(megatron, weights, size)
        )
    slow = normalize_weights([1.27e-4, 8.4e-6, 0.99986])  # forgets its state only slowly
    assert_indices_equal(
        build_blending_indices(slow, 400_000), cpp_indices(megatron, slow, 400_000)
    )


def test_blending_indices_correction_and_segments(megatron, monkeypatch):
    """With a one-step warm-up nearly every block starts wrong and must be corrected; tiny
    segments exercise the hand-over of exact state between segments."""
    monkeypatch.setattr(blending_indices, "_WARMUP", 1)
    monkeypatch.setattr(blending_indices, "_SEGMENT", 5_000)
    monkeypatch.setattr(blending_indices, "_MAX_LANES", 64)
    rng = np.random.default_rng(3)
    for n in (2, 3, 6):
        for size in (1_024, 4_999, 5_000, 5_001, 23_456):
            weights = random_weights(rng, n)
            assert_indices_equal(
                build_blending_indices(weights, size), cpp_indices(megatron, weights, size)
            )
            limits = rng.integers(1, 3 * size // n, n)
            assert_indices_equal(
                build_exhaustive_blending_indices(limits), cpp_exhaustive(megatron, limits)
            )


def test_exhaustive_blending_indices(megatron):
    rng = np.random.default_rng(4)
    for sizes in ([1], [1, 1], [3, 1, 2], [1, 10_000], [5, 5, 5, 5], [7, 300_000, 2]):
        assert_indices_equal(
            build_exhaustive_blending_indices(sizes), cpp_exhaustive(megatron, sizes)
        )
    for _ in range(12):
        n = int(rng.integers(2, 9))
        sizes = rng.integers(1, int(rng.choice([10, 1_000, 200_000])), n)
        ours = build_exhaustive_blending_indices(sizes)
        assert_indices_equal(ours, cpp_exhaustive(megatron, sizes))
        np.testing.assert_array_equal(np.bincount(ours[0], minlength=n), sizes)
        if sizes.sum() < 2_000:
            assert_indices_equal(ours, reference_loop(sizes / sizes.sum(), int(sizes.sum()), sizes))


def test_blending_indices_refuse_bad_input():
    with pytest.raises(ValueError, match="greater than zero"):
        build_blending_indices([0.5, 0.0], 10)
    with pytest.raises(ValueError, match="greater than zero"):
        build_blending_indices([0.5, float("nan")], 10)
    with pytest.raises(ValueError, match="1 to 32766 weights"):
        build_blending_indices([], 10)
    with pytest.raises(ValueError, match="size must be >= 0"):
        build_blending_indices([1.0], -1)
    with pytest.raises(ValueError, match="at least one sample"):
        build_exhaustive_blending_indices([3, 0])


# ------------------------------------------------------------------------- against megatron

ONE_BLEND_CASES = {
    "two-weighted": dict(n=2, weights=[0.3, 0.7], sizes=[300, 40, 8], split="90,8,2"),
    "three-weighted-multi-epoch": dict(
        n=3, weights=[0.2, 0.5, 0.3], sizes=[3000, 100, 20], split="80,15,5", seq=64, seed=7
    ),
    "three-seq17-no-extra": dict(
        n=3,
        weights=[5, 1, 2],
        sizes=[800, 60, 30],
        split="60,30,10",
        seq=17,
        seed=99,
        extra=False,
    ),
    "unweighted-with-sizes": dict(n=3, weights=None, sizes=[500, 50, 10], split="90,8,2"),
    "unweighted-exhaustive": dict(n=3, weights=None, sizes=[None] * 3, split="70,20,10", seq=48),
    "single-unweighted": dict(n=1, weights=None, sizes=[200, 20, 5], split="90,8,2"),
    "single-weighted": dict(n=1, weights=[2.0], sizes=[200, 20, 5], split="90,8,2"),
    "empty-test-split": dict(n=2, weights=[1, 1], sizes=[100, 10, 0], split="90,10,0"),
    "zero-test-samples": dict(n=2, weights=[1, 3], sizes=[100, 10, 0], split="80,10,10"),
}


@pytest.mark.parametrize("case", list(ONE_BLEND_CASES))
def test_one_blend_equals_megatron(megatron, prefixes, case):
    spec = dict(ONE_BLEND_CASES[case])
    chosen = prefixes[: spec.pop("n")]
    weights, sizes, split = spec.pop("weights"), spec.pop("sizes"), spec.pop("split")
    theirs = megatron_build(megatron, sizes, blend=(chosen, weights), split=split, **spec)
    ours = build_datasets(Blend(chosen, weights), our_config(split, **spec), sizes)
    assert_same(ours, theirs)


def test_unweighted_blend_refuses_more_samples_than_it_holds(prefixes):
    """Megatron shrinks an unweighted blend to what exists (a run then silently runs out of
    data); we refuse and say what to do."""
    with pytest.raises(ValueError, match=r"train: 1,000,000 samples requested.*give weights"):
        build_datasets(Blend(prefixes[:2], None), our_config("90,8,2", seq=128), [10**6, 1, 1])


def test_per_split_blends_equal_megatron(megatron, prefixes):
    a, b, c = prefixes
    blends = [([a, c], [1.0, 3.0]), ([b], None), ([a, b, c], None)]
    sizes = [400, 30, 50]
    theirs = megatron_build(megatron, sizes, per_split=blends, seq=24)
    ours = build_datasets(
        PerSplitBlend(*(Blend(*x) for x in blends)), our_config(None, seq=24), sizes
    )
    assert_same(ours, theirs)
    assert isinstance(ours[1], GPTDataset) and isinstance(ours[2], BlendedDataset)
    # no valid blend, exhaustive test blend, and the default split in our config is ignored
    blends = [([b, c], [0.5, 0.5]), None, ([c, a], None)]
    sizes = [120, None, None]
    theirs = megatron_build(megatron, sizes, per_split=blends, seed=5)
    ours = build_datasets(
        PerSplitBlend(Blend(*blends[0]), None, Blend(*blends[2])),
        our_config("969,30,1", seed=5),
        sizes,
    )
    assert_same(ours, theirs)


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group: megatron-core 0.16.1 needs one to cache blended indices."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_cached_blend_equals_megatron_and_reloads(
    megatron, prefixes, tmp_path, process_group, monkeypatch
):
    blend, sizes, split = (prefixes, [0.5, 0.25, 0.25]), [300, 30, 10], "80,10,10"
    theirs = megatron_build(megatron, sizes, blend=blend, split=split, cache=str(tmp_path / "m"))
    ours = build_datasets(Blend(*blend), our_config(split, cache=tmp_path / "o"), sizes)
    assert_same(ours, theirs)
    for dataset in ours:
        base = tmp_path / "o" / f"{dataset.unique_key}-BlendedDataset-{dataset.split}"
        for name in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy"):
            assert os.path.isfile(f"{base}-{name}")
        description = json.loads(open(f"{base}-description.txt").read())
        assert list(description) == ["class", "datasets", "split", "weights", "size"]
        assert description["size"] == len(dataset)

    def no_rebuild(*args):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(blended, "build_blending_indices", no_rebuild)
    again = build_datasets(Blend(*blend), our_config(split, cache=tmp_path / "o"), sizes)
    assert_same(again, theirs)
    # workers unpickle a cached blend by mapping its files again
    restored = pickle.loads(pickle.dumps(again[0]))
    np.testing.assert_array_equal(restored.dataset_index, theirs[0].dataset_index)
    np.testing.assert_array_equal(restored[5]["tokens"], theirs[0][5]["tokens"].numpy())


def test_mock_data(megatron):
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    sizes = [50, 10, 5]
    config = megatron.gpt.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=32,
        tokenizer=StubTokenizer(),
        split="1,1,1",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    builder = megatron.builder.BlendedMegatronDatasetBuilder(
        MockGPTDataset, sizes, lambda: True, config
    )
    theirs = builder.build()
    ours = build_datasets(MockData(VOCAB), our_config("969,30,1"), sizes)
    for o, t in zip(ours, theirs):
        for i in range(0, len(t), 997):
            np.testing.assert_array_equal(o[i]["tokens"], t[i]["tokens"].numpy())


# ----------------------------------------------------------------------------------- refusals


class FakeDataset:
    """A mid-level dataset stand-in: `length` samples whose tokens are their index."""

    def __init__(self, length: int, split: str = "train", name: str = "fake"):
        self.length, self.split, self.dataset_path = length, split, name
        self.unique_identifiers = {"class": "FakeDataset", "name": name, "length": length}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.length:
            raise IndexError(i)
        return {"tokens": np.array([i])}


def test_blended_dataset_access_and_oversampling():
    datasets = [FakeDataset(40, name="x"), FakeDataset(70, name="y")]
    blend = BlendedDataset(datasets, [3, 7], 100, our_config("90,8,2"), "train")
    assert blend.weights == [0.3, 0.7] and len(blend) == 100
    for k in (0, 1, 57, 99, -1):
        sample = blend[k]
        d, j = int(blend.dataset_index[k]), int(blend.dataset_sample_index[k])
        assert sample["dataset_id"] == d and sample["tokens"][0] == j
    with pytest.raises(IndexError, match="out of range"):
        blend[100]
    with pytest.raises(
        IndexError,
        match=r"draws 30 samples from dataset 0 \(x, train split\).*"
        r"has only 29; increase mid_level_dataset_surplus",
    ):
        BlendedDataset(
            [FakeDataset(29, name="x"), datasets[1]], [3, 7], 100, our_config("1"), "train"
        )
    exhaustive = BlendedDataset(datasets, [40, 70], None, our_config("1"), "train")
    assert len(exhaustive) == 110 and exhaustive.weights == [40, 70]


def test_blended_dataset_refusals():
    config = our_config("1")
    train = FakeDataset(10)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([train, train], [1.0], 5, config, "train")
    with pytest.raises(ValueError, match="into the train split"):
        BlendedDataset([train, FakeDataset(10, "valid")], [1, 1], 5, config, "train")
    with pytest.raises(ValueError, match="samples 0 must be greater than zero"):
        BlendedDataset([train, FakeDataset(0)], [10, 0], None, config, "train")
    with pytest.raises(ValueError, match="whole sample counts"):
        BlendedDataset([train, train], [1.5, 2], None, config, "train")
    with pytest.raises(ValueError, match="split must be one of"):
        BlendedDataset([train], [1], 5, config, "training")


def test_builder_refusals(prefixes, tmp_path):
    a, b, _ = prefixes
    with pytest.raises(FileNotFoundError, match=r"nope\.bin, .*nope\.idx"):
        build_datasets(Blend([a, str(tmp_path / "nope")], [1, 1]), our_config("1"), [10, 0, 0])
    with pytest.raises(
        ValueError, match="needs a number of samples for every split; none given for valid"
    ):
        build_datasets(Blend([a, b], [1, 1]), our_config("90,10,0"), [10, None, None])
    with pytest.raises(ValueError, match="weighted valid blend needs"):
        build_datasets(
            PerSplitBlend(None, Blend([a, b], [1, 1])), our_config(None), [10, None, None]
        )
    with pytest.raises(ValueError, match="one entry per split"):
        build_datasets(Blend([a, b]), our_config("1"), [10, 0])
    with pytest.raises(ValueError, match="config.split None"):
        build_datasets(Blend([a, b]), our_config(None), [10, 0, 0])
    with pytest.raises(ValueError, match="integer >= 0"):
        build_datasets(Blend([a, b]), our_config("1"), [-1, 0, 0])
    wide = write_dataset(tmp_path / "wide_text_document", 50, 9, dtype=np.int32)
    with pytest.raises(ValueError, match=rf"mixes token dtypes: .*uint16.*{wide} \(int32\)"):
        build_datasets(Blend([a, wide], [1, 1]), our_config("1"), [10, 0, 0])


def test_builder_refuses_mixed_tokenizers(tmp_path):
    from pipeline.preprocess import manifest

    def dataset_with_manifest(name, vocab_size, sha):
        prefix = write_dataset(tmp_path / f"{name}_text_document", 100, 1)
        record = {
            "format": manifest.MANIFEST_FORMAT,
            "tokenizer": {"vocab_size": vocab_size, "files": [{"path": "t.json", "sha256": sha}]},
            "outputs": {"text": {"prefix": prefix}},
        }
        manifest.write(tmp_path / f"{name}.json", record)
        return prefix

    a = dataset_with_manifest("a", 1000, "aa" * 32)
    same = dataset_with_manifest("same", 1000, "aa" * 32)
    other_vocab = dataset_with_manifest("vocab", 1024, "aa" * 32)
    other_file = dataset_with_manifest("file", 1000, "bb" * 32)
    unknown = write_dataset(tmp_path / "plain_text_document", 100, 2)  # no manifest: dtype only
    config = our_config("1", seq=8)
    assert len(build_datasets(Blend([a, same, unknown], [1, 1, 1]), config, [20, 0, 0])[0]) >= 20
    with pytest.raises(ValueError, match="mixes tokenizers: .*vocab size 1000.*vocab size 1024"):
        build_datasets(Blend([a, unknown, other_vocab], [1, 1, 1]), config, [20, 0, 0])
    with pytest.raises(ValueError, match="mixes tokenizers: .*aaaaaaaaaaaa.*bbbbbbbbbbbb"):
        build_datasets(PerSplitBlend(Blend([a]), Blend([other_file])), our_config(None), [5, 5, 0])


# ----------------------------------------------------------------------------------- describe


def test_describe_blend_matches_the_built_blend(prefixes):
    sequence_length, samples = 32, 2000
    blend = Blend(prefixes, [0.2, 0.5, 0.3])
    rows = describe_blend(blend, sequence_length, samples)
    built = build_datasets(blend, our_config("100,0,0", seq=sequence_length), [samples, 0, 0])[0]
    drawn = np.bincount(built.dataset_index, minlength=3)
    assert [r["samples"] for r in rows] == drawn.tolist()
    assert sum(r["samples"] for r in rows) == len(built) >= samples
    assert [r["weight"] for r in rows] == normalize_weights([0.2, 0.5, 0.3])
    for row, dataset in zip(rows, built.datasets):
        assert row["tokens"] == row["samples"] * sequence_length
        assert row["epochs"] == pytest.approx(row["tokens"] / row["tokens_per_epoch"])
        assert row["effective_weight"] == pytest.approx(row["samples"] / len(built))
        assert row["tokens_per_epoch"] == int(dataset.dataset.sequence_lengths.sum())
        expected_epochs = math.ceil(
            (dataset.num_samples * sequence_length + 1) / row["tokens_per_epoch"]
        )
        assert row["index_epochs"] == expected_epochs and row["exact"]
    lines = format_blend_description(rows, sequence_length)
    assert lines[0].split()[:3] == ["dataset", "weight", "effective"]
    assert all(p in "\n".join(lines) for p in prefixes) and lines[-1].startswith("total")


def test_describe_unweighted_blends(prefixes):
    rows = describe_blend(Blend(prefixes[:2]), 16, None)
    assert [r["samples"] for r in rows] == [r["samples_per_epoch"] for r in rows]
    assert all(r["epochs"] <= 1 for r in rows)
    capped = describe_blend(Blend(prefixes[:2]), 16, 100)
    assert sum(r["samples"] for r in capped) == 100
    single = describe_blend(Blend(prefixes[:1]), 16, 5000)  # a plain GPTDataset: many epochs
    assert single[0]["samples"] == 5000 and single[0]["epochs"] > 2
    assert single[0]["index_epochs"] == math.ceil(single[0]["epochs"] + 1e-9)
    with pytest.raises(ValueError, match="needs a number of samples"):
        describe_blend(Blend(prefixes[:2], [1, 1]), 16, None)
    with pytest.raises(FileNotFoundError, match="missing"):
        describe_blend(Blend(["nowhere/x"]), 16, 10)


def test_describe_refuses_what_training_would_refuse(prefixes):
    with pytest.raises(ValueError, match="unweighted blend holds only"):
        describe_blend(Blend(prefixes[:2], None), 16, 10**7)
