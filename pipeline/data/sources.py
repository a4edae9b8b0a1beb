"""Document sources sidecar (`{prefix}.sources`, written by `pipe preprocess --record-sources`):
for every document of a `.bin/.idx` pair, the input it came from and its line (JSONL) or row
(tabular), both as the unsharded run would number them. Input numbers index the `inputs` list
of the run's manifest, so a sample seen in training traces back to its raw line.

Layout: the 8-byte magic `PIPESRC1`, then one little-endian int64 pair (input, line) per
document, in document order. Shards of one run number inputs alike, so merging them is
concatenation.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.common.atomic import commit, temporary_path

MAGIC = b"PIPESRC1"
_ROW = np.dtype([("input", "<i8"), ("line", "<i8")])


def sources_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.sources")


class SourcesWriter:
    """Appends (input, line) rows under a temporary name; `finalize` renames it."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.path = sources_path(prefix)
        self._tmp = temporary_path(self.path)
        self._file = open(self._tmp, "wb")
        self._file.write(MAGIC)
        self.count = 0

    def add(self, input_index: int, lines: np.ndarray) -> None:
        rows = np.empty(len(lines), dtype=_ROW)
        rows["input"] = input_index
        rows["line"] = lines
        self._file.write(rows.tobytes())
        self.count += len(rows)

    def add_file(self, other: str | os.PathLike) -> None:
        """Append every row of another sources file (merging shards of one run)."""
        with open(other, "rb") as source:
            if source.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{other}: not a pipe sources file")
            before = self._file.tell()
            shutil.copyfileobj(source, self._file, 1 << 24)
            self.count += (self._file.tell() - before) // _ROW.itemsize

    def finalize(self) -> None:
        self._file.close()
        commit(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SourcesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._file.closed:
            self.abort()


def read_sources(prefix: str | os.PathLike) -> np.ndarray | None:
    """The (input, line) rows of a dataset, memory-mapped; None when it has no sources file."""
    path = sources_path(prefix)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not a pipe sources file")
    if path.stat().st_size == len(MAGIC):
        return np.empty(0, dtype=_ROW)
    return np.memmap(path, dtype=_ROW, mode="r", offset=len(MAGIC))
