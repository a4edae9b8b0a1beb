"""Byte streams of JSON-lines inputs: the lines of a plain, zstd or gzip file (or of a byte
range of a plain one), read in big chunks with the on-disk bytes counted for progress, the
file hashed as it is read, and a truncated zstd frame detected. The lines are passed on raw:
workers parse them.
"""

from __future__ import annotations

import functools
import gzip
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np
import zstandard

from pipeline.preprocess.inputs import InputError, InputRange

__all__ = ["LINE_KINDS", "LineSource", "lines_before"]

# Bytes per read of (decompressed) line data. Large enough that per-chunk Python overhead is
# nil, small enough to stay in CPU cache while split: measured faster than 4-16 MiB reads.
_READ_CHUNK = 1 << 20
# Bytes per read of compressed .zst data from disk.
_ZST_READ_SIZE = 1 << 20
LINE_KINDS = frozenset({"jsonl", "jsonl.zst", "jsonl.gz"})

# What a damaged compressed stream (or a failing disk) raises while being read.
_STREAM_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)


@functools.lru_cache(maxsize=64)
def lines_before(path: str, offset: int) -> int:
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


class LineSource:
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
