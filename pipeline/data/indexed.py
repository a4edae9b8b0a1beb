"""Megatron's indexed dataset (`.bin` + `.idx`, "MMIDIDX" version 1): writer and mmap reader.

The `.bin` file is every sequence's token ids back to back. The `.idx` file is a 34-byte header
(magic, version, dtype code, sequence count S, document-index length D) followed by the int32
sequence lengths, the int64 byte pointers and the int64 document indices. Files written here are
byte-identical to megatron-core's `IndexedDatasetBuilder` output for the same sequences.

The writer never holds per-sequence metadata in RAM (it spools it to disk), so memory stays flat
however large the corpus, and it writes under temporary names that are renamed only by `finalize`,
so an interrupted run leaves no final-named file behind.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeline.common.atomic import commit, temporary_path

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index length (8)
HEADER_SIZE = 34

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_CHUNK = 1 << 22  # elements per chunk when streaming index arrays


class IndexFormatError(ValueError):
    """An `.idx`/`.bin` pair that is not a valid Megatron indexed dataset (names the file)."""


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype Megatron's preprocess picks: uint16 below 65,500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """True when both `{prefix}.bin` and `{prefix}.idx` exist."""
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def normalize_prefix(path: str | os.PathLike) -> str:
    """Accept `prefix`, `prefix.bin` or `prefix.idx` and return the bare prefix."""
    text = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


# --------------------------------------------------------------------------------------- reader


class IndexedDataset:
    """Memory-mapped, zero-copy reader of a `.bin`/`.idx` pair.

    `ds[i]` is sequence i as a read-only numpy view into the mapped `.bin`; `ds.get(i, offset,
    length)` reads part of one. Pickles as its prefix, so DataLoader workers re-open the files.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = normalize_prefix(prefix)
        self._open()

    def _open(self) -> None:
        index_file, data_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file (indexed dataset '{self.prefix}')")
        header = read_index_header(index_file)
        self.dtype = header.dtype
        self._index = np.memmap(index_file, dtype=np.uint8, mode="r")
        count, docs = header.sequence_count, header.document_count
        offset = HEADER_SIZE
        self.sequence_lengths = _view(self._index, np.int32, offset, count)
        offset += 4 * count
        self.sequence_pointers = _view(self._index, np.int64, offset, count)
        offset += 8 * count
        self.document_indices = _view(self._index, np.int64, offset, docs)
        expected_bin = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if count
            else 0
        )
        actual_bin = data_file.stat().st_size
        if actual_bin != expected_bin:
            raise IndexFormatError(
                f"{data_file}: {actual_bin} bytes, but {index_file} describes {expected_bin} "
                "(truncated or mismatched .bin)"
            )
        if docs and int(self.document_indices[-1]) != count:
            raise IndexFormatError(
                f"{index_file}: document index ends at {int(self.document_indices[-1])}, "
                f"expected the sequence count {count}"
            )
        self._data = (
            np.memmap(data_file, dtype=self.dtype, mode="r")
            if actual_bin
            else np.empty(0, dtype=self.dtype)
        )

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def _start(self, i: int) -> int:
        return int(self.sequence_pointers[i]) // self.dtype.itemsize

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous (step 1)")
            return [self[j] for j in range(start, stop)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        start = self._start(i)
        return self._data[start : start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of sequence i starting at token `offset` (to its end by default)."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = self._start(i) + offset
        return self._data[start : start + length]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's tokens (its sequences concatenated); an empty document gives []."""
        for d in range(self.num_documents):
            lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
            if lo == hi:
                yield np.empty(0, dtype=self.dtype)
            else:
                start = self._start(lo)
                end = self._start(hi - 1) + int(self.sequence_lengths[hi - 1])
                yield self._data[start:end]


class IndexHeader:
    """The fixed 34-byte header of an `.idx` file."""

    def __init__(self, dtype: np.dtype, sequence_count: int, document_count: int):
        self.dtype = dtype
        self.sequence_count = sequence_count
        self.document_count = document_count


def read_index_header(path: str | os.PathLike) -> IndexHeader:
    """Parse and validate an `.idx` header, checking the file size against it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE or raw[:9] != INDEX_MAGIC:
        raise IndexFormatError(f"{path}: not a Megatron indexed dataset index (bad magic)")
    (version,) = struct.unpack("<Q", raw[9:17])
    if version != INDEX_VERSION:
        raise IndexFormatError(f"{path}: index version {version}, only version 1 is supported")
    (code,) = struct.unpack("<B", raw[17:18])
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"{path}: unknown dtype code {code}")
    count, docs = struct.unpack("<QQ", raw[18:34])
    expected = HEADER_SIZE + 12 * count + 8 * docs
    # Multimodal files append one int8 mode per sequence; their token data reads the same.
    if size not in (expected, expected + count):
        raise IndexFormatError(
            f"{path}: {size} bytes, but its header describes {expected} "
            f"({count} sequences, {docs} document-index entries): truncated or corrupt"
        )
    return IndexHeader(np.dtype(DTYPE_CODES[code]), count, docs)


def _view(buffer: np.ndarray, dtype: type[np.generic], offset: int, count: int) -> np.ndarray:
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


# --------------------------------------------------------------------------------------- writer


class _Spool:
    """An append-only array of one dtype kept in a temporary file rather than in RAM."""

    def __init__(self, dtype: type[np.generic], directory: Path):
        self.dtype = np.dtype(dtype)
        self._file = tempfile.TemporaryFile(dir=directory, prefix=".pipe-spool-")
        self.count = 0

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self._file.write(values.data)
        self.count += len(values)

    def chunks(self) -> Iterator[np.ndarray]:
        self._file.flush()
        self._file.seek(0)
        remaining = self.count
        while remaining:
            n = min(remaining, _CHUNK)
            yield np.frombuffer(self._file.read(n * self.dtype.itemsize), dtype=self.dtype)
            remaining -= n

    def close(self) -> None:
        self._file.close()


class IndexedDatasetWriter:
    """Write one `.bin`/`.idx` pair, streaming; the files appear under their final names only
    when `finalize()` succeeds.

    Use as a context manager: leaving the block with an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type[np.generic]):
        self.prefix = normalize_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        final_bin = bin_path(self.prefix)
        directory = final_bin.parent
        directory.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = temporary_path(final_bin)
        self._tmp_idx = temporary_path(idx_path(self.prefix))
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = _Spool(np.int32, directory)
        self._document_ends = _Spool(np.int64, directory)
        self.num_tokens = 0
        self._closed = False

    @property
    def num_sequences(self) -> int:
        return self._lengths.count

    @property
    def num_documents(self) -> int:
        return self._document_ends.count

    def add_document(
        self, tokens: np.ndarray | Sequence[int], lengths: Sequence[int] | None = None
    ) -> None:
        """Append one document: `tokens`, split into sequences of `lengths` (one sequence if None).

        An empty `lengths` list makes a document with no sequence, as Megatron does for empty text.
        """
        tokens = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            lengths = [len(tokens)]
        self.add_documents(tokens, np.asarray(lengths, np.int32), np.array([len(lengths)]))

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray
    ) -> None:
        """Append many documents at once: the flat tokens, each sequence's length and each
        document's number of sequences (0 for an empty document)."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        if int(sequence_lengths.sum(dtype=np.int64)) != len(tokens):
            raise ValueError("sequence lengths do not add up to the number of tokens")
        self._bin.write(tokens.data)
        self.num_tokens += len(tokens)
        ends = self.num_sequences + np.cumsum(sequences_per_document, dtype=np.int64)
        self._lengths.append(sequence_lengths)
        self._document_ends.append(ends)

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every document of another indexed dataset of the same dtype (a merge)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"{idx_path(other.prefix)}: dtype {other.dtype} differs from {self.dtype} "
                "of the datasets before it; cannot merge mixed dtypes"
            )
        base = self.num_sequences
        for start in range(0, len(other.sequence_lengths), _CHUNK):
            self._lengths.append(other.sequence_lengths[start : start + _CHUNK])
        for start in range(1, len(other.document_indices), _CHUNK):
            self._document_ends.append(other.document_indices[start : start + _CHUNK] + base)
        with open(bin_path(other.prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, 1 << 24)
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the index and move both files to their final names (`.bin` first, `.idx` last)."""
        self._bin.close()
        with open(self._tmp_idx, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", _CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", self.num_sequences))
            f.write(struct.pack("<Q", self.num_documents + 1))
            for chunk in self._lengths.chunks():
                f.write(chunk.data)
            offset = np.int64(0)
            for chunk in self._lengths.chunks():
                sizes = chunk.astype(np.int64) * self.dtype.itemsize
                pointers = np.cumsum(sizes) - sizes + offset
                f.write(pointers.data)
                if len(sizes):
                    offset = pointers[-1] + sizes[-1]
            f.write(np.zeros(1, np.int64).data)
            for chunk in self._document_ends.chunks():
                f.write(chunk.data)
        commit(self._tmp_bin, bin_path(self.prefix))
        commit(self._tmp_idx, idx_path(self.prefix))
        self._release()

    def abort(self) -> None:
        """Drop everything written so far (no file is left under a final or temporary name)."""
        if self._closed:
            return
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        self._lengths.close()
        self._document_ends.close()
        self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._closed:
            self.abort()
