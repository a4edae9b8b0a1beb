"""Record readers of `pipe preprocess`: stream the documents of the inputs in batches.

The main process only reads; worker processes parse, validate and tokenize. So this module never
decodes or parses JSON lines: it hands raw line bytes (`byte_streams.py`) or, for tabular inputs
(Parquet, Arrow, JSON through `datasets`, saved datasets), row dicts to the caller in batches of
bounded size, numbered so that a worker can report `file:line` for any bad document. Reading
streams in fixed-size chunks, so memory does not grow with the input size. Finding the inputs is
`inputs.py`; its names are re-exported here.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.preprocess.byte_streams import LINE_KINDS, LineSource, lines_before
from pipeline.preprocess.inputs import InputError, InputFile, InputRange, resolve_inputs

__all__ = [
    "Batch",
    "InputError",
    "InputFile",
    "InputRange",
    "file_line",
    "iter_batches",
    "resolve_inputs",
]

# Rows per Arrow slice taken from tabular inputs before regrouping into batches.
_TABLE_ROWS = 1024


@dataclass
class Batch:
    """A run of consecutive documents from one file, the unit of work sent to a worker."""

    index: int  # 0, 1, 2, ... over the whole run, in input order
    source: str  # path of the file these items come from (never spans two files)
    first_line: int  # 1-based number of the first item counted from start_byte (tabular: row)
    lines: list[bytes] | None  # JSONL kinds: raw lines without the newline; blank line is b""
    records: list[dict] | None  # tabular kinds: rows restricted to the requested keys
    nbytes: int  # on-disk (compressed) bytes consumed for this batch, for progress
    # Byte offset of the line numbered 1 above: 0 (the file's first line) unless this batch
    # comes from a range of a split file; `file_line` turns numbers into the file's own.
    start_byte: int = 0
    part: int = 0  # position of its file (or range) in the list given to iter_batches


def file_line(batch: Batch, offset: int) -> int:
    """The 1-based line number in the file of item `offset` of `batch`.

    For a batch from the middle of a split file this counts the newlines before its range
    once per process (only when asked: i.e. to report a bad line), so a shard's errors name
    the same file:line as the unsharded run's.
    """
    line = batch.first_line + offset
    return line + lines_before(batch.source, batch.start_byte) if batch.start_byte else line


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def iter_batches(
    inputs: Sequence[InputFile | InputRange],
    keys: Sequence[str],
    *,
    batch_bytes: int = 1 << 20,
    max_batch_items: int = 1024,
    on_hashed: Callable[[int, str], None] | None = None,
) -> Iterator[Batch]:
    """Stream the documents of `inputs` (whole files, or ranges of plain JSONL files), in order,
    as batches of consecutive items of one file.

    A batch closes as soon as its items reach `batch_bytes` (uncompressed; a line counts with
    its newline) or `max_batch_items`, so it may exceed `batch_bytes` by its last item. The
    last batch of each file is usually smaller. `keys` selects the columns kept for tabular
    inputs; JSONL lines are passed on raw. A file that yields no items but has bytes on disk
    (e.g. an empty .gz) gives one empty batch, so that nbytes always sums to the input size.

    With `on_hashed`, each whole JSONL file is hashed (SHA-256) from the bytes read for it,
    with no second pass, and `on_hashed(position, hexdigest)` is called when it is done.
    """
    if batch_bytes < 1 or max_batch_items < 1:
        raise ValueError("batch_bytes and max_batch_items must be >= 1")
    counter = itertools.count()
    keys = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))  # dedup, order kept
    for position, item in enumerate(inputs):
        part = item if isinstance(item, InputRange) else InputRange.whole(item)
        if not part.is_whole and part.file.kind != "jsonl":
            raise ValueError(f"{part.file.path}: only plain JSONL can be read in part")
        hashed = on_hashed is not None and streams_hash(part)
        source: LineSource | _TableSource
        if part.file.kind in LINE_KINDS:
            source = LineSource(part, hashlib.sha256() if hashed else None)
        else:
            source = _TableSource(part.file, keys)
        grouper = _Grouper(batch_bytes, max_batch_items)
        for batch in _file_batches(part, source, grouper, counter):
            batch.part = position
            yield batch
        if on_hashed is not None and isinstance(source, LineSource) and source.digest:
            on_hashed(position, source.digest.hexdigest())


def streams_hash(part: InputRange) -> bool:
    """True when `iter_batches` hashes this part while reading it (a whole JSONL file)."""
    return part.is_whole and part.file.kind in LINE_KINDS


def _file_batches(
    part: InputRange,
    source: LineSource | _TableSource,
    grouper: _Grouper,
    counter: Iterator[int],
) -> Iterator[Batch]:
    """Turn one file's item chunks into Batches, numbering lines and attributing disk bytes.

    Each closed group is held back until the next one exists, so that the file's final batch
    (which gets whatever remains of the range's size) is known to be final when it is yielded.
    """
    tabular = isinstance(source, _TableSource)
    size = part.size
    reported = 0
    next_line = 1
    held: tuple[list[Any], int] | None = None  # (items, estimated disk bytes consumed so far)

    def make(items: list[Any], nbytes: int) -> Batch:
        nonlocal reported, next_line
        batch = Batch(
            index=next(counter),
            source=part.file.path,
            first_line=next_line,
            lines=None if tabular else items,
            records=items if tabular else None,
            nbytes=nbytes,
            start_byte=0 if tabular else source.line_start,
        )
        reported += nbytes
        next_line += len(items)
        return batch

    items_done = bytes_done = 0
    for chunk_items, cumsizes in source.chunks():
        for items, nbytes_uncompressed in grouper.add(chunk_items, cumsizes):
            if held is not None:
                yield make(held[0], max(0, min(held[1], size) - reported))
            items_done += len(items)
            bytes_done += nbytes_uncompressed
            held = (items, source.consumed(items_done, bytes_done))
    rest = grouper.flush()
    if rest is not None:
        if held is not None:
            yield make(held[0], max(0, min(held[1], size) - reported))
        held = (rest, size)
    if held is None:
        if size > 0:
            yield make([], size)
        return
    yield make(held[0], size - reported)


class _Grouper:
    """Cuts a stream of items (arriving in chunks) into groups closed by byte size or count.

    Works per group, not per item: the cut points are found with a binary search over the
    chunk's cumulative sizes, which keeps the per-line cost in C for the plain JSONL fast path.
    """

    def __init__(self, batch_bytes: int, max_items: int) -> None:
        self.batch_bytes = batch_bytes
        self.max_items = max_items
        self._items: list[Any] = []
        self._bytes = 0

    def add(self, items: list[Any], cumsizes: np.ndarray) -> Iterator[tuple[list[Any], int]]:
        """Add a chunk of items (with cumulative sizes, each size >= 1); yield every group that
        closes, as (items, uncompressed bytes)."""
        pos, base, n = 0, 0, len(items)
        while pos < n:
            need = self.batch_bytes - self._bytes
            room = self.max_items - len(self._items)
            # First index whose running size reaches the budget; sizes >= 1 make cumsizes
            # strictly increasing, so the search cannot land before `pos`.
            reach = int(np.searchsorted(cumsizes, base + need, side="left"))
            end = min(reach + 1, pos + room, n)
            if self._items:
                self._items.extend(items[pos:end])
            else:
                self._items = items[pos:end]
            new_base = int(cumsizes[end - 1])
            self._bytes += new_base - base
            pos, base = end, new_base
            if len(self._items) >= self.max_items or self._bytes >= self.batch_bytes:
                yield self._take()

    def flush(self) -> list[Any] | None:
        """Return the partly filled group at the end of a file, if any."""
        return self._take()[0] if self._items else None

    def _take(self) -> tuple[list[Any], int]:
        group = (self._items, self._bytes)
        self._items, self._bytes = [], 0
        return group


# --------------------------------------------------------------------------------------------
# Tabular inputs (parquet, arrow, json through datasets, saved datasets)
# --------------------------------------------------------------------------------------------


class _TableSource:
    """Streams the rows of a tabular input as dicts restricted to the requested keys."""

    def __init__(self, inp: InputFile, keys: list[str]) -> None:
        self.inp = inp
        self.keys = keys
        self.total_rows: int | None = None  # known up front for all kinds but json

    def chunks(self) -> Iterator[tuple[list[dict], np.ndarray]]:
        """Yield (rows, cumulative sizes) per Arrow slice of at most _TABLE_ROWS rows."""
        opener = {
            "parquet": self._parquet,
            "arrow": self._arrow,
            "json": self._json,
            "hf_dataset": self._hf_dataset,
        }.get(self.inp.kind)
        if opener is None:
            raise InputError(f"{self.inp.path}: unknown input kind {self.inp.kind!r}")
        tables = opener()
        while True:
            try:
                table = next(tables)
                table = table.select([k for k in self.keys if k in table.column_names])
                rows = table.to_pylist()
                sizes = _row_sizes(table)
            except StopIteration:
                return
            except InputError:
                raise
            except Exception as e:  # pyarrow/datasets raise many types for a damaged file
                raise InputError(f"{self.inp.path}: cannot read {self.inp.kind}: {e}") from e
            if rows:
                yield rows, np.cumsum(sizes)

    def consumed(self, items_done: int, bytes_done: int) -> int:
        """Estimate the disk bytes behind the first `items_done` rows: the file size spread
        evenly over the rows, or (row count unknown) the uncompressed size read so far."""
        if self.total_rows:
            return self.inp.size * items_done // self.total_rows
        return bytes_done

    def _parquet(self) -> Iterator[Any]:
        """Row slices of a parquet file, reading only the requested columns."""
        pq = _import_pyarrow(self.inp.path, "parquet")
        pf = self._guard(lambda: pq.ParquetFile(self.inp.path))
        self.total_rows = pf.metadata.num_rows
        columns = [k for k in self.keys if k in pf.schema_arrow.names]
        return pf.iter_batches(batch_size=_TABLE_ROWS, columns=columns)

    def _arrow(self) -> Iterator[Any]:
        """Row slices of an Arrow IPC file (file or stream format), memory-mapped."""
        pa = _import_pyarrow(self.inp.path, "arrow")
        path = self.inp.path

        def open_batches() -> Iterator[Any]:
            source = pa.memory_map(path)
            try:
                reader = pa.ipc.open_file(source)
                return (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: try the stream format from the start
                return iter(pa.ipc.open_stream(pa.memory_map(path)))

        # Counting rows is a pass over batch headers of the mapped file: no data is copied.
        self.total_rows = self._guard(lambda: sum(b.num_rows for b in open_batches()))
        batches = self._guard(open_batches)
        return (b.slice(i, _TABLE_ROWS) for b in batches for i in range(0, b.num_rows, _TABLE_ROWS))

    def _json(self) -> Iterator[Any]:
        """Row slices of a .json file (JSON array or JSON lines) read through `datasets`.

        `load_dataset` leaves lock files in its cache even when streaming, so it gets a private
        temporary cache that is removed when the file is done.
        """
        datasets = _import_datasets(self.inp.path)
        with tempfile.TemporaryDirectory(prefix="pipe-readers-") as cache_dir:
            ds = self._guard(
                lambda: datasets.load_dataset(
                    "json",
                    data_files=[self.inp.path],
                    split="train",
                    streaming=True,
                    cache_dir=cache_dir,
                )
            )
            yield from ds.with_format("arrow").iter(batch_size=_TABLE_ROWS)

    def _hf_dataset(self) -> Iterator[Any]:
        """Row slices of a directory written by `save_to_disk` (memory-mapped by `datasets`)."""
        datasets = _import_datasets(self.inp.path)
        ds = self._guard(lambda: datasets.load_from_disk(self.inp.path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                splits = ", ".join(ds)
                raise InputError(f"{self.inp.path}: DatasetDict has no 'train' split ({splits})")
            ds = ds["train"]
        self.total_rows = len(ds)
        return ds.with_format("arrow").iter(batch_size=_TABLE_ROWS)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Call `fn`, turning any failure to open/read the input into an InputError."""
        try:
            return fn()
        except InputError:
            raise
        except Exception as e:  # pyarrow/datasets raise many types for a damaged file
            raise InputError(f"{self.inp.path}: cannot read {self.inp.kind}: {e}") from e


def _row_sizes(table: Any) -> np.ndarray:
    """Approximate uncompressed size of each row of an Arrow table/batch, for batch_bytes.

    Exact for string/binary columns (the documents); other columns get their average width.
    Every row counts at least 1 byte, so cumulative sizes strictly increase.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    sizes = np.ones(n, dtype=np.int64)
    for column in table.columns:
        t = column.type
        if (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or (pa.types.is_large_binary(t))
        ):
            sizes += np.asarray(pc.binary_length(column).fill_null(0), dtype=np.int64)
        elif n:
            sizes += column.nbytes // n
    return sizes


def _import_pyarrow(path: str, kind: str) -> Any:
    """Import pyarrow (with parquet support when asked) lazily, or explain how to get it."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401 - makes pa.ipc available

        return pa
    except ImportError as e:
        raise InputError(f"{path}: reading {kind} needs pyarrow: pip install pyarrow") from e


def _import_datasets(path: str) -> Any:
    """Import `datasets` lazily, strictly offline and without progress bars."""
    # Must be set before the first import: datasets reads them into its config at import time.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise InputError(f"{path}: reading this input needs `datasets`: install datasets") from e
    datasets.disable_progress_bars()
    return datasets
