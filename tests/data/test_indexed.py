"""The .bin/.idx format: byte layout from docs/file_layouts.md; megatron-core checks both ways."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pipeline.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    IndexFormatError,
    optimal_dtype,
)
from tests.builders import file_bytes, megatron_builder

# Documents as lists of sequences; the empty list is a document with no sequence.
DOCUMENTS = [[[5, 6, 7]], [], [[1], [2, 3]], [[9] * 10], [], []]


def write_ours(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document([t for seq in doc for t in seq], [len(s) for s in doc])
        writer.finalize()
    return prefix


def write_megatron(prefix, documents, dtype):
    builder_cls, _ = megatron_builder()
    builder = builder_cls(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document([t for seq in doc for t in seq], [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_idx_layout_byte_by_byte(tmp_path):
    """Header, lengths, pointers and document indices as docs/file_layouts.md lays them out."""
    write_ours(tmp_path / "d", DOCUMENTS, np.uint16)
    idx = (tmp_path / "d.idx").read_bytes()
    lengths = [3, 1, 2, 10]
    pointers = [0, 6, 8, 12]  # bytes: uint16 items
    doc_idx = [0, 1, 1, 3, 4, 4, 4]
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 4)
        + struct.pack("<Q", 7)
        + struct.pack("<4i", *lengths)
        + struct.pack("<4q", *pointers)
        + struct.pack("<7q", *doc_idx)
    )
    assert idx == expected
    bin_data = np.frombuffer((tmp_path / "d.bin").read_bytes(), dtype="<u2")
    assert bin_data.tolist() == [5, 6, 7, 1, 2, 3] + [9] * 10


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_matches_megatron_builder(tmp_path, dtype):
    ours = write_ours(tmp_path / "ours", DOCUMENTS, dtype)
    theirs = write_megatron(tmp_path / "theirs", DOCUMENTS, dtype)
    assert file_bytes(ours) == file_bytes(theirs)


def test_megatron_reads_ours_and_we_read_megatrons(tmp_path):
    _, megatron_dataset = megatron_builder()
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 128_000, rng.integers(0, 50)).tolist() for _ in range(rng.integers(0, 3))]
        for _ in range(200)
    ]
    documents = [[s for s in doc if s] for doc in documents]
    ours = IndexedDataset(write_ours(tmp_path / "ours", documents, np.int32))
    theirs = megatron_dataset(str(write_megatron(tmp_path / "theirs", documents, np.int32)))
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i], theirs[i])
    long = max(range(len(ours)), key=lambda i: ours.sequence_lengths[i])
    np.testing.assert_array_equal(ours.get(long, 2, 5), theirs.get(long, 2, 5))
    assert [d.tolist() for d in ours.documents()] == [sum(doc, []) for doc in documents]


def test_reader_is_zero_copy_and_picklable(tmp_path):
    import pickle

    ds = IndexedDataset(write_ours(tmp_path / "d", DOCUMENTS, np.uint16))
    assert not ds[0].flags.writeable  # a view into the read-only map, not a copy
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3].tolist() == [9] * 10
    assert ds.num_tokens == 16 and ds.num_documents == 6


def test_optimal_dtype_threshold():
    assert optimal_dtype(32_000) == np.uint16
    assert optimal_dtype(65_499) == np.uint16
    assert optimal_dtype(65_500) == np.int32
    assert optimal_dtype(128_256) == np.int32


def test_truncated_files_are_refused_by_name(tmp_path):
    prefix = write_ours(tmp_path / "d", DOCUMENTS, np.uint16)
    idx = tmp_path / "d.idx"
    full = idx.read_bytes()
    idx.write_bytes(full[:-3])
    with pytest.raises(IndexFormatError, match="d.idx"):
        IndexedDataset(prefix)
    idx.write_bytes(full)
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-2])
    with pytest.raises(IndexFormatError, match="d.bin"):
        IndexedDataset(prefix)
    idx.write_bytes(b"NOTANIDX" + full[8:])
    with pytest.raises(IndexFormatError, match="bad magic"):
        IndexedDataset(prefix)


def test_abort_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_merge_mixed_dtypes_refused(tmp_path):
    a = write_ours(tmp_path / "a", DOCUMENTS, np.uint16)
    b = write_ours(tmp_path / "b", DOCUMENTS, np.int32)
    with IndexedDatasetWriter(tmp_path / "m", np.uint16) as writer:
        writer.add_index(a)
        with pytest.raises(ValueError, match="b.idx.*int32"):
            writer.add_index(b)
