"""SHA-256 of files, byte ranges of files and streams, read in chunks so memory stays flat."""

from __future__ import annotations

import hashlib
import os
from typing import Any

CHUNK_BYTES = 8 << 20


def hash_stream(handle: Any, digest: Any, nbytes: int | None = None) -> int:
    """Feed the next `nbytes` of `handle` (all that is left when None) to `digest`, read in
    chunks; returns how many bytes there were (fewer than asked at the end of the file)."""
    done = 0
    while nbytes is None or done < nbytes:
        want = CHUNK_BYTES if nbytes is None else min(CHUNK_BYTES, nbytes - done)
        block = handle.read(want)
        if not block:
            break
        digest.update(block)
        done += len(block)
    return done


def sha256_file(path: str | os.PathLike, *, start: int = 0, end: int | None = None) -> str:
    """Hex SHA-256 of a file, or of its bytes [start, end)."""
    return sha256_file_and_size(path, start=start, end=end)[0]


def sha256_file_and_size(
    path: str | os.PathLike, *, start: int = 0, end: int | None = None
) -> tuple[str, int]:
    """(hex SHA-256, number of bytes hashed) of a file, or of its bytes [start, end)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(start)
        size = hash_stream(handle, digest, None if end is None else end - start)
    return digest.hexdigest(), size
