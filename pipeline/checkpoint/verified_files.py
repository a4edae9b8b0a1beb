"""Read a checkpoint's files once, hashing each front to back as it is read.

`VerifiedFiles` serves byte ranges of the files of one checkpoint directory. For every file it
*owns* it keeps a running SHA-256 and the position hashed so far: a read at that position is
hashed as it passes, a read further on first hashes the gap (keeping the bytes of ranges the
caller will want later, within a memory budget), and when nothing more is wanted from a file
its tail is hashed and the digest compared with `pipe_metadata.json`. A mismatch, a wrong size,
a file missing from the record or a short read raises `CheckpointError` naming the file, before
the caller has used the bad bytes to commit anything. Every byte of an owned file is hashed
exactly once and read from disk once (ranges read out of order beyond the budget are read
again, but never hashed twice).

With several ranks each file has one owner (`owner_of`), so the checkpoint is hashed once in
all, and a rank resuming in the layout it saved owns the files it reads anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checkpoint.layout import PIPE_METADATA, CheckpointError
from pipeline.common.hashing import hash_stream

SKIP_HINT = "pass --no-verify-checksums to read it anyway"
_SHARD_NAME = re.compile(r"^__(\d+)_(\d+)\.distcp$")


@dataclass
class _Running:
    """Hashing state of one owned file."""

    size: int
    digest: Any = field(default_factory=hashlib.sha256)
    position: int = 0
    done: bool = False


def owner_of(names: list[str], world_size: int) -> dict[str, int]:
    """The rank that hashes each data file: files in (saving rank, index) order, dealt out in
    turn, so rank r of a run resumed in its saving layout owns the shard it wrote (`__r_0`)."""

    def order(name: str) -> tuple:
        match = _SHARD_NAME.match(name)
        return (0, int(match.group(1)), int(match.group(2))) if match else (1, 0, 0, name)

    return {name: i % world_size for i, name in enumerate(sorted(names, key=order))}


class VerifiedFiles:
    """Byte ranges of `directory`'s files, hashed while read (see the module docstring).

    `recorded`: the `files` map of `pipe_metadata.json` ({name: {size, sha256}}), or None to
    read without verifying. `owned(name)` says which files this process hashes (default: all).
    Call `finish` to complete a file, or declare with `want` what will be read over time.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        recorded: dict[str, dict[str, Any]] | None,
        *,
        owned: Any = None,
        budget: int = 1 << 30,
    ) -> None:
        self.directory = Path(directory)
        self.recorded = recorded
        self._owned = owned or (lambda name: True)
        self._budget = budget
        self._running: dict[str, _Running] = {}
        self._kept: dict[tuple[str, int, int], bytes] = {}
        self._kept_bytes = 0
        self.want({})

    def want(self, wanted: dict[str, list[tuple[int, int]]]) -> None:
        """Declare, per file, the (offset, length) ranges the caller will read over time: a
        file is completed as soon as its last wanted range has been read, and wanted ranges a
        read skips over are kept (up to the budget) for their own read."""
        self._wanted = {name: sorted(ranges) for name, ranges in wanted.items() if ranges}
        self._last = {name: max(o + n for o, n in ranges) for name, ranges in self._wanted.items()}

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of file `name`, hashed on the way when owned."""
        kept = self._kept.pop((name, offset, length), None)
        if kept is not None:
            self._kept_bytes -= length
            return kept
        path = self.directory / name
        with open(path, "rb") as handle:
            running = self._running_state(name, handle)
            if running is None or running.done or offset < running.position:
                handle.seek(offset)
                return _read_exact(handle, path, offset, length)
            self._hash_gap(name, handle, running, offset)
            data = _read_exact(handle, path, offset, length)
            running.digest.update(data)
            running.position += length
            if running.position >= self._last.get(name, running.size + 1):
                self._finish(name, handle, running)
        return data

    def read_whole(self, name: str) -> bytes:
        """A whole (small) file, verified before it is returned."""
        path = self.directory / name
        with open(path, "rb") as handle:
            running = self._running_state(name, handle)
            data = handle.read()
            if running is not None and not running.done:
                running.digest.update(data[running.position :])
                running.position = len(data)
                self._finish(name, handle, running)
        return data

    def finish(self, name: str) -> None:
        """Hash what is left of an owned file and compare it with the record."""
        path = self.directory / name
        with open(path, "rb") as handle:
            running = self._running_state(name, handle)
            if running is not None and not running.done:
                self._finish(name, handle, running)

    def _running_state(self, name: str, handle: Any) -> _Running | None:
        """The file's hashing state (created on first touch, checking its size), or None when
        this process does not verify it."""
        if self.recorded is None or not self._owned(name):
            return None
        running = self._running.get(name)
        if running is None:
            path = self.directory / name
            expected = self.recorded.get(name)
            if expected is None:
                raise CheckpointError(f"{path}: not listed in {PIPE_METADATA}; {SKIP_HINT}")
            size = os.fstat(handle.fileno()).st_size
            if size != expected.get("size"):
                raise CheckpointError(
                    f"{path}: {size} bytes, {PIPE_METADATA} records {expected.get('size')} "
                    f"(truncated or replaced); {SKIP_HINT}"
                )
            running = self._running[name] = _Running(size=size)
        return running

    def _hash_gap(self, name: str, handle: Any, running: _Running, end: int) -> None:
        """Hash [position, end), keeping the wanted ranges inside it while the budget allows."""
        handle.seek(running.position)
        for offset, length in self._wanted.get(name, ()):
            if offset < running.position or offset + length > end:
                continue
            hash_stream(handle, running.digest, offset - running.position)
            data = _read_exact(handle, self.directory / name, offset, length)
            running.digest.update(data)
            if self._kept_bytes + length <= self._budget:
                self._kept[(name, offset, length)] = data
                self._kept_bytes += length
            running.position = offset + length
        hash_stream(handle, running.digest, end - running.position)
        running.position = end

    def _finish(self, name: str, handle: Any, running: _Running) -> None:
        handle.seek(running.position)
        running.position += hash_stream(handle, running.digest, running.size - running.position)
        running.done = True
        path = self.directory / name
        if running.position != running.size:
            raise CheckpointError(f"{path}: shorter than its {running.size} bytes while read")
        if running.digest.hexdigest() != self.recorded[name].get("sha256"):  # type: ignore[index]
            raise CheckpointError(
                f"{path}: SHA-256 differs from {PIPE_METADATA} (the file is corrupt); {SKIP_HINT}"
            )


def _read_exact(handle: Any, path: Path, offset: int, length: int) -> bytes:
    """`length` bytes from the handle's position, or an error saying the file is truncated."""
    data = handle.read(length)
    if len(data) != length:
        size = os.fstat(handle.fileno()).st_size
        raise CheckpointError(
            f"{path}: truncated: {size} bytes, the checkpoint needs bytes up to {offset + length}"
        )
    return data
