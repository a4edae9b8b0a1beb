"""Input side of `pipe preprocess`: find the input files and stream their documents in batches.

The main process only reads; worker processes parse, validate and tokenize. So this module never
decodes or parses JSON lines: it hands raw line bytes (or, for tabular inputs, row dicts) to the
caller in batches of bounded size, numbered so that a worker can report `file:line` for any bad
document. Reading streams in fixed-size chunks, so memory does not grow with the input size.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import itertools
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import zstandard

__all__ = [
    "Batch",
    "InputError",
    "InputFile",
    "InputRange",
    "file_line",
    "iter_batches",
    "resolve_inputs",
]

# Bytes per read of (decompressed) line data. Large enough that per-chunk Python overhead is
# nil, small enough to stay in CPU cache while split: measured faster than 4-16 MiB reads.
_READ_CHUNK = 1 << 20
# Bytes per read of compressed .zst data from disk.
_ZST_READ_SIZE = 1 << 20
# Rows per Arrow slice taken from tabular inputs before regrouping into batches.
_TABLE_ROWS = 1024

# Checked in order, on the lower-cased file name; the first matching suffix wins.
_SUFFIX_KINDS: tuple[tuple[str, str], ...] = (
    (".zst", "jsonl.zst"),
    (".gz", "jsonl.gz"),
    (".jsonl", "jsonl"),
    (".ndjson", "jsonl"),
    (".parquet", "parquet"),
    (".arrow", "arrow"),
    (".json", "json"),
)
_KNOWN_SUFFIXES = ".jsonl, .ndjson, .jsonl.zst, .zst, .jsonl.gz, .gz, .parquet, .arrow, .json"
_LINE_KINDS = frozenset({"jsonl", "jsonl.zst", "jsonl.gz"})

# What a damaged compressed stream (or a failing disk) raises while being read.
_STREAM_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)


class InputError(ValueError):
    """A problem with the inputs themselves (missing file, unknown format, unreadable/corrupt file);
    the message names the file."""


@dataclass(frozen=True)
class InputFile:
    """One input as resolved from the command line."""

    path: str  # as given/expanded; for a DatasetDict directory, its "train" split directory
    kind: str  # "jsonl" | "jsonl.zst" | "jsonl.gz" | "parquet" | "arrow" | "json" | "hf_dataset"
    size: int  # bytes on disk (for a dataset dir: sum of its data files)


@dataclass(frozen=True)
class InputRange:
    """The part of one input a (sharded) run reads: the lines whose first byte lies in
    [start, end) of the file on disk. Only plain JSONL can be read in part; other kinds are
    always whole (start 0, end size)."""

    file: InputFile
    start: int
    end: int

    @classmethod
    def whole(cls, f: InputFile) -> InputRange:
        return cls(f, 0, f.size)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.end == self.file.size

    @property
    def size(self) -> int:
        return self.end - self.start


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
    return line + _lines_before(batch.source, batch.start_byte) if batch.start_byte else line


@functools.lru_cache(maxsize=64)
def _lines_before(path: str, offset: int) -> int:
    """Newlines in the first `offset` bytes of a plain file."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            data = f.read(min(offset, _READ_CHUNK))
            if not data:
                break
            count += data.count(b"\n")
            offset -= len(data)
    return count


# --------------------------------------------------------------------------------------------
# Resolving command-line specs into files
# --------------------------------------------------------------------------------------------


def resolve_inputs(specs: Sequence[str]) -> list[InputFile]:
    """Expand input specs (files, globs, saved `datasets` directories) into a list of inputs.

    Globs are expanded in sorted order so a run is reproducible. Duplicates are kept, in the
    order given: the user asked for them (e.g. to upsample a source).
    """
    if not specs:
        raise InputError("no inputs given")
    return [_classify(path) for spec in specs for path in _expand(spec)]


def _expand(spec: str) -> list[str]:
    """Return the paths a spec stands for: itself, or the sorted matches of a glob."""
    path = os.path.expanduser(spec)
    # A path that exists is taken literally even if it contains glob characters.
    if os.path.exists(path) or not any(c in path for c in "*?["):
        return [path]
    matches = sorted(glob.glob(path, recursive=True))
    if not matches:
        raise InputError(f"{spec}: no files match this pattern")
    return matches


def _classify(path: str) -> InputFile:
    """Make an InputFile for one existing path, deciding its kind from the name (or layout)."""
    if os.path.isdir(path):
        return _dataset_dir(path)
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    kind = _kind_from_name(path)
    return InputFile(path=path, kind=kind, size=os.path.getsize(path))


def _kind_from_name(path: str) -> str:
    """Map a file name's suffix to an input kind, or raise InputError for an unknown one."""
    name = os.path.basename(path).lower()
    for suffix, kind in _SUFFIX_KINDS:
        if name.endswith(suffix):
            return kind
    raise InputError(
        f"{path}: unknown input format (expected {_KNOWN_SUFFIXES}, "
        "or a directory written by datasets' save_to_disk)"
    )


def _dataset_dir(path: str) -> InputFile:
    """Resolve a directory written by `Dataset.save_to_disk` (or the train split of a
    `DatasetDict.save_to_disk` directory) into an hf_dataset input."""
    dict_json = os.path.join(path, "dataset_dict.json")
    if os.path.exists(dict_json):
        splits = _read_json(dict_json).get("splits", [])
        if "train" not in splits:
            raise InputError(
                f"{path}: DatasetDict has no 'train' split (splits: {', '.join(splits) or 'none'});"
                " pass the directory of the split to use instead"
            )
        path = os.path.join(path, "train")
    has_meta = any(
        os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json")
    )
    if not has_meta:
        raise InputError(
            f"{path}: is a directory but not a dataset saved with datasets' save_to_disk "
            f"(no dataset_info.json/state.json); for a directory of files pass a glob "
            f"such as '{os.path.join(path, '*.jsonl')}'"
        )
    data_files = _dataset_data_files(path)
    if not data_files:
        raise InputError(f"{path}: saved dataset has no .arrow data files")
    return InputFile(path=path, kind="hf_dataset", size=sum(map(os.path.getsize, data_files)))


def _dataset_data_files(path: str) -> list[str]:
    """The .arrow files of a saved dataset: those listed in state.json, else all *.arrow."""
    state = os.path.join(path, "state.json")
    if os.path.exists(state):
        names = [f.get("filename") for f in _read_json(state).get("_data_files", [])]
        files = [os.path.join(path, n) for n in names if n]
        if files and all(os.path.isfile(f) for f in files):
            return files
    return sorted(glob.glob(os.path.join(glob.escape(path), "*.arrow")))


def _read_json(path: str) -> dict[str, Any]:
    """Load a small JSON metadata file, turning any failure into an InputError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read dataset metadata: {e}") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}: dataset metadata is not a JSON object")
    return data


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
        source: _LineSource | _TableSource
        if part.file.kind in _LINE_KINDS:
            source = _LineSource(part, hashlib.sha256() if hashed else None)
        else:
            source = _TableSource(part.file, keys)
        grouper = _Grouper(batch_bytes, max_batch_items)
        for batch in _file_batches(part, source, grouper, counter):
            batch.part = position
            yield batch
        if on_hashed is not None and isinstance(source, _LineSource) and source.digest:
            on_hashed(position, source.digest.hexdigest())


def streams_hash(part: InputRange) -> bool:
    """True when `iter_batches` hashes this part while reading it (a whole JSONL file)."""
    return part.is_whole and part.file.kind in _LINE_KINDS


def _file_batches(
    part: InputRange,
    source: _LineSource | _TableSource,
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
# JSON lines (plain, zstd, gzip)
# --------------------------------------------------------------------------------------------


class _CountingReader:
    """Wraps the raw file to count the on-disk bytes read (progress is in compressed bytes)
    and to let a frame tracker and a hasher see them."""

    def __init__(self, f: BinaryIO, observers: list[Callable[[bytes], Any]]) -> None:
        self._f = f
        self._observers = observers
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self.count += len(data)
        for observe in self._observers:
            observe(data)
        return data

    def close(self) -> None:
        """Nothing to do: the caller owns and closes the underlying file."""


class _RangeReader:
    """Reads the lines of a plain file whose first byte lies in [start, end): it starts at the
    first line start at or after `start` and stops at the end of the line holding byte end - 1
    (or at end of file). Ranges that meet at a cut thus read every line exactly once."""

    def __init__(self, f: BinaryIO, start: int, end: int) -> None:
        self._f = f
        self.line_start = self._align(start)
        f.seek(self.line_start)
        self._pos = self.line_start
        self._end = end
        self._done = self.line_start >= end

    def _align(self, start: int) -> int:
        """The first line start at or after `start`: just past the first newline at or after
        byte start - 1 (or the end of the file when there is none)."""
        if start == 0:
            return 0
        pos = start - 1
        self._f.seek(pos)
        while data := self._f.read(_READ_CHUNK):
            newline = data.find(b"\n")
            if newline >= 0:
                return pos + newline + 1
            pos += len(data)
        return pos

    def read(self, size: int = -1) -> bytes:
        if self._done:
            return b""
        if self._pos < self._end:  # inside the range
            data = self._f.read(min(size, self._end - self._pos))
            self._pos += len(data)
            self._done = not data or (self._pos == self._end and data.endswith(b"\n"))
            return data
        data = self._f.read(size)  # past the range: finish its last line
        newline = data.find(b"\n")
        if not data or newline >= 0:
            self._done = True
            return data[: newline + 1] if newline >= 0 else data
        return data


class _ZstdFrameTracker:
    """Follows zstd frame and block headers in the compressed stream to tell whether the file
    ends on a frame boundary.

    Needed because the zstd stream reader stops silently at a truncated frame. Only headers are
    parsed (a few per 128 KiB block), so this costs next to nothing next to decompression.
    """

    _MAGIC, _SKIP_SIZE, _FRAME_HEADER, _BLOCK = range(4)
    _HEADER_BYTES = {_MAGIC: 4, _SKIP_SIZE: 4, _FRAME_HEADER: 1, _BLOCK: 3}

    def __init__(self) -> None:
        self._state = self._MAGIC
        self._buf = b""
        self._skip = 0
        self._checksum = False

    def feed(self, data: bytes) -> None:
        """Advance over the next raw bytes of the file."""
        pos, n = 0, len(data)
        while pos < n:
            if self._skip:
                step = min(self._skip, n - pos)
                self._skip -= step
                pos += step
                continue
            want = self._HEADER_BYTES[self._state] - len(self._buf)
            self._buf += data[pos : pos + want]
            pos += want
            if len(self._buf) < self._HEADER_BYTES[self._state]:
                return
            header, self._buf = int.from_bytes(self._buf, "little"), b""
            self._parse(header)

    def _parse(self, header: int) -> None:
        """Interpret one complete header and set up what follows it."""
        if self._state == self._MAGIC:
            if header == 0xFD2FB528:
                self._state = self._FRAME_HEADER
            elif header & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame
                self._state = self._SKIP_SIZE
            else:
                # Not zstd: the decompressor reports this itself; stop tracking.
                self._state, self._skip = self._MAGIC, 1 << 62
        elif self._state == self._SKIP_SIZE:
            self._state, self._skip = self._MAGIC, header
        elif self._state == self._FRAME_HEADER:
            single_segment = bool(header & 0x20)
            self._checksum = bool(header & 0x04)
            window = 0 if single_segment else 1
            dict_id = (0, 1, 2, 4)[header & 0x03]
            content_size = ((1 if single_segment else 0), 2, 4, 8)[header >> 6]
            self._state, self._skip = self._BLOCK, window + dict_id + content_size
        else:
            block_type, block_size = (header >> 1) & 0x03, header >> 3
            self._skip = 1 if block_type == 1 else block_size  # RLE blocks store one byte
            if header & 0x01:  # last block of the frame
                self._skip += 4 if self._checksum else 0
                self._state = self._MAGIC

    @property
    def complete(self) -> bool:
        """True when everything fed so far ends exactly at the end of a frame."""
        return self._state == self._MAGIC and not self._buf and not self._skip


class _LineSource:
    """Streams the lines of a JSONL file (plain, .zst or .gz), or of a range of a plain one, in
    big chunks."""

    def __init__(self, part: InputRange, digest: Any = None) -> None:
        self.inp = part.file
        self.part = part
        self.digest = digest  # a hashlib object fed the file's bytes as they are read
        self.line_start = 0  # byte offset of the first line read (set when reading starts)
        self._raw: _CountingReader | None = None
        self._decompressed = 0

    def chunks(self) -> Iterator[tuple[list[bytes], np.ndarray]]:
        """Yield (lines, cumulative sizes) per chunk read; a line's size includes its newline."""
        path, kind = self.inp.path, self.inp.kind
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise InputError(f"{path}: cannot open: {e.strerror or e}") from e
        with f:
            tracker = _ZstdFrameTracker() if kind == "jsonl.zst" else None
            base: Any = f
            if not self.part.is_whole:
                base = _RangeReader(f, self.part.start, self.part.end)
                self.line_start = base.line_start
            observers = [o.update for o in [self.digest] if o is not None]
            observers += [tracker.feed] if tracker else []
            self._raw = raw = _CountingReader(base, observers)
            stream: Any = raw
            if kind == "jsonl.zst":
                stream = zstandard.ZstdDecompressor().stream_reader(
                    raw, read_size=_ZST_READ_SIZE, read_across_frames=True, closefd=False
                )
            elif kind == "jsonl.gz":
                stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[arg-type]
            for lines, has_cr in _split_lines(self._read_chunks(stream)):
                sizes = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
                if has_cr:
                    lines = [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]
                yield lines, np.cumsum(sizes + 1)
            if self.digest is not None:
                while raw.read(_READ_CHUNK):  # bytes a decoder left unread still count
                    pass
            if tracker is not None and not tracker.complete:
                raise InputError(f"{path}: corrupt or truncated {kind} file (ends mid-frame)")

    def _read_chunks(self, stream: Any) -> Iterator[bytes]:
        """Read decompressed chunks until EOF, turning decoder/disk failures into InputError."""
        while True:
            try:
                data = stream.read(_READ_CHUNK)
            except _STREAM_ERRORS as e:
                what = "read error" if self.inp.kind == "jsonl" else "corrupt or truncated file"
                raise InputError(f"{self.inp.path}: {what} ({self.inp.kind}): {e}") from e
            if not data:
                return
            self._decompressed += len(data)
            yield data

    def consumed(self, items_done: int, bytes_done: int) -> int:
        """Estimate the disk bytes behind the first `bytes_done` decompressed bytes."""
        assert self._raw is not None
        if self._decompressed <= 0:
            return 0
        return self._raw.count * bytes_done // self._decompressed


def _split_lines(chunks: Iterator[bytes]) -> Iterator[tuple[list[bytes], bool]]:
    """Split a stream of byte chunks into lists of complete lines (split on b"\\n" only), each
    with a flag telling whether the lines may contain b"\\r" (so CRLF ends need stripping).

    A final line without a newline counts; a newline at EOF does not add an empty line. A line
    longer than a chunk is collected in pieces and joined once, so it costs linear time.
    """
    tail: list[bytes] = []
    for data in chunks:
        if data.rfind(b"\n") < 0:
            tail.append(data)
            continue
        lines = data.split(b"\n")
        if tail:
            # Join only the carried-over line; joining the whole chunk would cost a full copy.
            tail.append(lines[0])
            lines[0] = b"".join(tail)
            tail = []
        last = lines.pop()  # text after the chunk's last newline: start of the next line
        if last:
            tail.append(last)
        # A C-speed scan; JSON text never holds a raw CR, so LF files skip the per-line strip.
        yield lines, b"\r" in data or lines[0].endswith(b"\r")
    if tail:
        line = b"".join(tail)
        yield [line], line.endswith(b"\r")


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
