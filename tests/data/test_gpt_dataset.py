"""GPTDataset: every sample equal to megatron-core 0.16.1's GPTDataset, index helpers equal to its
C++ helpers, and clear errors where Megatron hangs or fails."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest

from pipeline.data import sample_index
from pipeline.data.gpt_dataset import (
    INDEX_NAMES,
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_datasets,
    parse_split,
    split_sequence_indices,
)
from pipeline.data.indexed import IndexedDataset, IndexedDatasetWriter
from pipeline.data.mock import MockGPTLowLevelDataset, build_mock_gpt_datasets
from pipeline.data.sample_index import build_sample_index, count_samples, plan_epochs
from tests.builders import quiet_megatron

VOCAB, EOD, PAD = 1000, 3, 7
SAMPLE_DTYPES = {
    "tokens": np.int64,
    "labels": np.int64,
    "attention_mask": np.bool_,
    "loss_mask": np.float32,
    "position_ids": np.int64,
}


# ----------------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's dataset modules, imported quietly, or skip when not installed."""
    with quiet_megatron():
        from megatron.core.datasets import gpt_dataset as mgpt
        from megatron.core.datasets import helpers
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.blended_megatron_dataset_config import (
            convert_split_vector_to_split_matrix,
            parse_and_normalize_split,
        )

    class Namespace:
        pass

    ns = Namespace()
    ns.gpt, ns.helpers, ns.Builder = mgpt, helpers, BlendedMegatronDatasetBuilder
    ns.split_matrix = lambda s: convert_split_vector_to_split_matrix(parse_and_normalize_split(s))
    return ns


class StubTokenizer:
    """What megatron-core's datasets read from a tokenizer."""

    def __init__(self, pad: int | None):
        self.vocab_size, self.eod, self._pad = VOCAB, EOD, pad

    @property
    def pad(self) -> int:
        if self._pad is None:
            raise AttributeError("pad")
        return self._pad

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "StubTokenizer"}


def megatron_config(m, sequence_length: int, split: str | None, prefix: str | None, **kw):
    return m.gpt.GPTDatasetConfig(
        random_seed=kw.get("random_seed", 1234),
        sequence_length=sequence_length,
        blend=None if prefix is None else ([prefix], None),
        blend_per_split=kw.get("blend_per_split"),
        split=split,
        path_to_cache=None,
        tokenizer=StubTokenizer(kw.get("pad_id")),
        reset_position_ids=kw.get("reset_position_ids", False),
        reset_attention_mask=kw.get("reset_attention_mask", False),
        eod_mask_loss=kw.get("eod_mask_loss", False),
        create_attention_mask=kw.get("create_attention_mask", True),
        add_extra_token_to_sequence=kw.get("add_extra_token_to_sequence", True),
        drop_last_partial_validation_sequence=kw.get("drop_last_partial_validation_sequence", True),
    )


def our_config(sequence_length: int, split: str, **kw) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        sequence_length=sequence_length, eod_id=EOD, tokenizer_id="stub", split=split, **kw
    )


def assert_same_datasets(theirs: list, ours: list, samples: list | None = None) -> None:
    """Same splits, lengths, index arrays (values and dtypes) and samples, in order."""
    assert len(theirs) == len(ours)
    for t, o in zip(theirs, ours):
        if t is None:
            assert o is None
            continue
        assert len(o) == len(t)
        for name in INDEX_NAMES:
            a, b = np.asarray(getattr(t, name)), np.asarray(getattr(o, name))
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        for i in [*(range(len(t)) if samples is None else samples), None]:
            a, b = t[i], o[i]
            assert list(a) == list(b)
            for key in a:
                assert b[key].dtype == SAMPLE_DTYPES[key], key
                np.testing.assert_array_equal(a[key].numpy(), b[key], err_msg=f"{key} @ {i}")


def compare(m, prefix: str, sequence_length: int, split: str, sizes: list, **kw) -> list:
    theirs = m.Builder(
        m.gpt.GPTDataset,
        sizes,
        lambda: True,
        megatron_config(m, sequence_length, split, prefix, **kw),
    ).build()
    ours = build_gpt_datasets(prefix, our_config(sequence_length, split, **kw), sizes)
    assert_same_datasets(theirs, ours)
    return ours


# ----------------------------------------------------------------------------------- data


def write_dataset(prefix, num_sequences: int, max_length: int, seed: int) -> str:
    """Random sequences incl. 1-token and zero-length ones, in documents of 0, 1 or 2 sequences;
    most documents end with EOD and some hold one inside."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, num_sequences).astype(np.int32)
    lengths[rng.random(num_sequences) < 0.06] = 1
    lengths[rng.random(num_sequences) < 0.04] = 0
    per_document = []
    left = num_sequences
    while left:
        count = min(left, int(rng.choice([0, 1, 1, 1, 2])))
        per_document.append(count)
        left -= count
    tokens = rng.integers(1, VOCAB, int(lengths.sum())).astype(np.uint16)
    tokens[tokens == EOD] = EOD + 1
    ends = np.cumsum(lengths)
    tokens[ends[(lengths > 0) & (rng.random(num_sequences) < 0.7)] - 1] = EOD
    tokens[rng.integers(0, len(tokens), len(tokens) // 50)] = EOD
    tokens[rng.integers(0, len(tokens), len(tokens) // 100)] = PAD
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(tokens, lengths, np.array(per_document))
        writer.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """300 sequences of 0..12 tokens."""
    return write_dataset(tmp_path_factory.mktemp("gpt") / "small", 300, 12, seed=1)


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> str:
    """3000 sequences of 0..60 tokens."""
    return write_dataset(tmp_path_factory.mktemp("gpt") / "medium", 3000, 60, seed=2)


# ----------------------------------------------------------------------------------- samples

CASES = {
    "969-30-1": ("medium", 32, "969,30,1", [500, 50, 10], {}),
    "seq-len-1": ("small", 1, "98/2/0", [300, 20, 0], {}),
    "longer-than-documents": ("small", 64, "1,1,1", [20, 30, 5], {"random_seed": 7}),
    "no-extra-token-partial-valid": (
        "medium",
        48,
        "90,8,2",
        [None, None, 30],
        {"add_extra_token_to_sequence": False, "drop_last_partial_validation_sequence": False},
    ),
    "partial-valid-extra-token": (
        "small",
        5,
        "1,1,1",
        [100, 400, 100],
        {"drop_last_partial_validation_sequence": False, "random_seed": 0},
    ),
    "reset-flags-pad": (
        "medium",
        40,
        "90,8,2",
        [300, 100, 10],
        {
            "reset_position_ids": True,
            "reset_attention_mask": True,
            "eod_mask_loss": True,
            "pad_id": PAD,
            "drop_last_partial_validation_sequence": False,
            "random_seed": 31337,
        },
    ),
    "pad-equals-eod-reset-mask": (
        "small",
        16,
        "8,1,1",
        [50, 50, 50],
        {"reset_attention_mask": True, "pad_id": EOD, "add_extra_token_to_sequence": False},
    ),
    "no-attention-mask": (
        "small",
        10,
        "7,2,1",
        [None, 40, 40],
        {"create_attention_mask": False, "eod_mask_loss": True, "reset_position_ids": True},
    ),
}


@pytest.mark.filterwarnings("ignore:The pad token id in the tokenizer collides")
@pytest.mark.parametrize("case", CASES)
def test_samples_equal_megatron(megatron, small, medium, case):
    name, sequence_length, split, sizes, kw = CASES[case]
    prefix = {"small": small, "medium": medium}[name]
    compare(megatron, prefix, sequence_length, split, sizes, **kw)


@pytest.mark.parametrize(("epochs", "separate"), [(2.1, True), (2.7, True), (2.88, False)])
def test_multi_epoch_equal_megatron(megatron, small, epochs, separate):
    """Three epochs; the final one is shuffled apart when it holds < 80% of an epoch."""
    lengths = IndexedDataset(small).sequence_lengths
    train = split_sequence_indices(parse_split("1,1,1"), len(lengths))[0]
    tokens, length = int(lengths[train].sum()), 8
    wanted = int(epochs * tokens / length)
    plan = plan_epochs(tokens, wanted, length, 1)
    assert (plan.num_epochs, plan.separate_final_epoch) == (3, separate)
    ours = compare(megatron, small, length, "1,1,1", [wanted, None, None], random_seed=5)
    assert len(ours[0]) >= wanted


def test_whole_prefix_for_one_split_equals_megatron_per_split_blend(megatron, small):
    """What `--valid-data-path PREFIX` builds: all of a prefix for one split, no split string."""
    config = megatron_config(megatron, 8, None, None, blend_per_split=[None, ([small], None), None])
    theirs = megatron.Builder(megatron.gpt.GPTDataset, [None, 300, None], lambda: True, config)
    ours = build_gpt_datasets(
        small, our_config(8, "1,1,1"), [None, 300, None], split_matrix=[None, (0.0, 1.0), None]
    )
    assert_same_datasets(theirs.build(), ours)
    description = json.loads(ours[1].unique_description)
    assert description["split"] is None and description["split_matrix"] is None
    assert description["sequence_range"] == [0, 300]
    mid_level = build_gpt_datasets(small, our_config(8, "0,1"), [None, 300, None])[1]
    assert mid_level.unique_key != ours[1].unique_key
    # Passing the config's own matrix changes nothing.
    config = our_config(8, "1,1,1")
    same = build_gpt_datasets(small, config, [5, 5, 5], split_matrix=config.split_matrix)
    assert same[1].unique_key == build_gpt_datasets(small, config, [5, 5, 5])[1].unique_key


class ListDataset:
    """The least a low-level dataset must offer."""

    def __init__(self, sequences: list[list[int]]):
        self.sequences = [np.array(s, dtype=np.int32) for s in sequences]
        self.sequence_lengths = np.array([len(s) for s in sequences], dtype=np.int32)

    def __len__(self) -> int:
        return len(self.sequences)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        end = None if length is None else offset + length
        return self.sequences[i][offset:end]


@pytest.mark.parametrize("drop_last", [True, False])
def test_any_low_level_dataset_works(drop_last):
    """Sample k is the stream (sequences in document-index order) at shuffle[k] * S."""
    low_level = ListDataset([[1, 2, 3], [], [4, 5, EOD], [6], [8, 9, 10, 11, 12]])
    config = our_config(2, None, drop_last_partial_validation_sequence=drop_last)
    dataset = GPTDataset(low_level, None, np.arange(5, dtype=np.int32), 7, "valid", config)
    stream = np.concatenate([low_level.sequences[i] for i in dataset.document_index])
    stream = np.concatenate([stream, [0, 0]])  # the padded tail, pad ids replaced by 0
    assert len(dataset) == (11 if drop_last else 12)  # two epochs of 12 tokens
    for k in range(len(dataset)):
        start = int(dataset.shuffle_index[k]) * 2
        np.testing.assert_array_equal(dataset[k]["tokens"], stream[start : start + 2])
        np.testing.assert_array_equal(dataset[k]["labels"], stream[start + 1 : start + 3])


def test_batch_padding_sample_has_zero_loss(small):
    dataset = build_gpt_datasets(small, our_config(8, "1,1,1"), [10, None, None])[0]
    padded, first = dataset[None], dataset[0]
    assert not padded["loss_mask"].any()
    np.testing.assert_array_equal(padded["tokens"], first["tokens"])


def test_pickled_dataset_maps_its_cache_again(small, tmp_path):
    config = our_config(8, "1,1,1", path_to_cache=str(tmp_path))
    dataset = build_gpt_datasets(small, config, [50, None, None])[0]
    blob = pickle.dumps(dataset)
    assert len(blob) < 20_000  # the index arrays travel as file paths
    clone = pickle.loads(blob)
    for i in range(len(dataset)):
        np.testing.assert_array_equal(clone[i]["tokens"], dataset[i]["tokens"])


# ----------------------------------------------------------------------------- index helpers


def random_stream(rng, positions: int, max_length: int, last_non_empty: bool):
    sizes = rng.integers(0, max_length + 1, positions + 3).astype(np.int32)
    sizes[rng.random(len(sizes)) < 0.2] = 0
    document_index = rng.permutation(len(sizes)).astype(np.int32)[:positions]
    if last_non_empty:
        sizes[document_index[-1]] = max(int(sizes[document_index[-1]]), 2)
    return sizes, document_index


@pytest.mark.parametrize("chunk", [5, 1 << 16])
@pytest.mark.parametrize("add_extra", [0, 1])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_equals_cpp_helper(megatron, monkeypatch, chunk, add_extra, drop_last):
    """Zero-length sequences, sample lengths below and above the sequence lengths, several
    epochs, chunk boundaries anywhere."""
    monkeypatch.setattr(sample_index, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk + 2 * add_extra + int(drop_last))
    for trial in range(40):
        sizes, document_index = random_stream(rng, int(rng.integers(1, 60)), 9, True)
        epochs = int(rng.integers(1, 4))
        document_index = np.tile(document_index, epochs)
        tokens = int(sizes[document_index].sum()) // epochs
        length = int(rng.choice([1, 2, 3, 4, 7, 16, 50]))
        args = (sizes, document_index, length, epochs, tokens, drop_last, add_extra)
        expected = megatron.helpers.build_sample_idx(*args)
        actual = build_sample_index(*args)
        assert actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected, err_msg=f"trial {trial}: {args}")


def test_sample_index_handles_empty_last_sequence(megatron):
    """Megatron writes offset -1 and fails an assertion; we point at the last non-empty one."""
    sizes = np.array([5, 3, 0], dtype=np.int32)
    document_index = np.arange(3, dtype=np.int32)
    args = (sizes, document_index, 3, 1, 8, False, 1)
    with pytest.raises(AssertionError):
        megatron.helpers.build_sample_idx(*args)
    assert build_sample_index(*args).tolist() == [[0, 0], [0, 3], [1, 1], [1, 2]]


def test_partial_sample_count_uses_float32(megatron):
    """ceil(float32(33,554,434) / 2) = 16,777,216, one less than the exact count."""
    tokens, length = 33_554_435, 2
    assert count_samples(1, tokens, length, False, 1) == 16_777_216
    assert count_samples(1, tokens, length, True, 1) == 16_777_217
    sizes = np.array([tokens - 3, 1, 2], dtype=np.int32)
    document_index = np.array([0, 1, 2], dtype=np.int32)
    args = (sizes, document_index, length, 1, tokens, False, 1)
    expected = megatron.helpers.build_sample_idx(*args)
    assert len(expected) - 1 == 16_777_216
    np.testing.assert_array_equal(build_sample_index(*args), expected)


@pytest.mark.parametrize(
    "split", ["969,30,1", "969, 30, 1", "98/2/0", "1,1,1", "1", "0,1", "2,0,3", ".5,.25,.25"]
)
def test_parse_split_equals_megatron(megatron, split):
    assert parse_split(split) == megatron.split_matrix(split)


@pytest.mark.parametrize("split", ["1,2,3,4", "0,0,0", "", "1.2.3"])
def test_parse_split_rejects(split):
    with pytest.raises(ValueError, match="split"):
        parse_split(split)


def test_split_indices_use_bankers_rounding():
    # 0.5 * 5 = 2.5 rounds to 2, 0.9 * 5 = 4.5 rounds to 4.
    ranges = split_sequence_indices([(0, 0.5), (0.5, 0.9), (0.9, 1.0)], 5)
    assert [r.tolist() for r in ranges] == [[0, 1], [2, 3], [4]]
    assert split_sequence_indices([(0, 1.0), None, None], 3)[1] is None


# ----------------------------------------------------------------------------- identity


def test_description_keys_follow_megatron(megatron, small, tmp_path):
    config = megatron_config(megatron, 8, "1,1,1", small)
    theirs = megatron.Builder(megatron.gpt.GPTDataset, [10, 5, 5], lambda: True, config).build()
    ours = build_gpt_datasets(small, our_config(8, "1,1,1"), [10, 5, 5])
    their_keys = list(theirs[0].unique_identifiers)
    our_keys = list(json.loads(ours[0].unique_description))
    assert our_keys[: len(their_keys)] == their_keys
    assert our_keys[len(their_keys) :] == [
        "add_extra_token_to_sequence",
        "drop_last_partial_sequence",
        "num_sequences",
        "sequence_range",
    ]
    description = ours[1].unique_description
    assert ours[1].unique_key == hashlib.md5(description.encode()).hexdigest()
    assert (
        json.loads(description)["split_matrix"]
        == json.loads(theirs[1].unique_description)["split_matrix"]
    )


def key_of(prefix: str, split: int, **kw) -> str:
    datasets = build_gpt_datasets(prefix, our_config(8, "1,1,1", **kw), [10, 10, 10])
    return datasets[split].unique_key


def test_key_covers_what_changes_the_indices(small):
    base = key_of(small, 1)
    assert key_of(small, 1, add_extra_token_to_sequence=False) != base
    assert key_of(small, 1, drop_last_partial_validation_sequence=False) != base
    assert key_of(small, 1, random_seed=1) != base
    # Flags that only shape samples, and the valid-only flag on other splits, keep the key.
    assert key_of(small, 1, reset_position_ids=True, eod_mask_loss=True, pad_id=PAD) == base
    assert key_of(small, 0, drop_last_partial_validation_sequence=False) == key_of(small, 0)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.timeout(30)
def test_zero_token_split_is_refused_not_looped(tmp_path):
    """Megatron loops forever here (#957): 969,30,1 of 202 sequences leaves test [202, 202)."""
    prefix = write_dataset(tmp_path / "tiny", 202, 10, seed=3)
    with pytest.raises(ValueError) as error:
        build_gpt_datasets(prefix, our_config(8, "969,30,1"), [100, 10, 10])
    message = str(error.value)
    for part in (prefix, "test split", "no sequences", "969,30,1", "--split"):
        assert part in message
    # No test sample asked of it: an empty test dataset, not an error about "0 samples".
    assert len(build_gpt_datasets(prefix, our_config(8, "969,30,1"), [100, 10, 0])[2]) == 0


@pytest.mark.timeout(30)
def test_split_of_empty_sequences_is_refused(tmp_path):
    prefix = str(tmp_path / "empties")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i in range(20):
            writer.add_document([5] * (3 if i < 10 else 0))
        writer.finalize()
    config = our_config(4, "1,1")
    with pytest.raises(ValueError, match=r"valid split \(sequences \[10, 20\) of 20"):
        build_gpt_datasets(prefix, config, [5, 5, None])
    # Asking for nothing from the empty split is fine (an empty dataset, as Megatron).
    assert len(build_gpt_datasets(prefix, config, [5, None, None])[1]) == 0


def test_missing_prefix_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.idx"):
        build_gpt_datasets(tmp_path / "nowhere", our_config(8, "1,1,1"), [1, 1, 1])


@pytest.mark.parametrize("length", [0, -3])
def test_sequence_length_must_be_positive(length):
    with pytest.raises(ValueError, match="sequence_length"):
        our_config(length, "1,1,1")


def test_num_samples_needs_three_entries(small):
    with pytest.raises(ValueError, match="one entry per split"):
        build_gpt_datasets(small, our_config(8, "1,1,1"), [10, 10])


# ----------------------------------------------------------------------------- mock


def test_mock_low_level_equals_megatron(megatron):
    theirs = megatron.gpt.MockGPTLowLevelDataset(StubTokenizer(None))
    ours = MockGPTLowLevelDataset(VOCAB, EOD)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    for i in (0, 1, 77, 99_999):
        np.testing.assert_array_equal(ours[i], theirs[i])
        np.testing.assert_array_equal(ours.get(i, 2, 5), theirs.get(i, 2, 5))
        np.testing.assert_array_equal(ours.get(i, 3), theirs.get(i, 3))


def test_mock_dataset_equals_megatron(megatron):
    sizes = [300, 30, 30]
    config = megatron_config(megatron, 512, None, None)
    theirs = megatron.Builder(megatron.gpt.MockGPTDataset, sizes, lambda: True, config).build()
    ours = build_mock_gpt_datasets(our_config(512, "969,30,1"), sizes, VOCAB)
    rng = np.random.default_rng(0)
    picks = [*range(200), *rng.integers(0, len(theirs[0]), 100).tolist()]
    assert_same_datasets(theirs, ours, samples=picks)
    assert json.loads(ours[0].unique_description)["split"] == "1,1,1"
