"""Durable writes that never leave a half-written file under its final name.

Every output is written under a temporary name beside its final one, flushed and fsynced, then
renamed over the final name, and the parent directory is fsynced so the rename itself survives
a crash. One naming scheme for all temporaries, `.{final name}.tmp-{host}-{pid}-{random}`:
hidden, unique per writer, and recording which process wrote it, so a cleaner can tell a
crashed writer's leftovers (`temporary_owner`) from a live writer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMPORARY_MARK = ".tmp-"


def temporary_path(final: str | os.PathLike) -> Path:
    """A fresh hidden name beside `final` to write it under (see the module docstring)."""
    final = Path(final)
    owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return final.with_name(f".{final.name}{TEMPORARY_MARK}{owner}")


def temporary_owner(path: str | os.PathLike) -> tuple[str, int] | None:
    """(host, pid) of the writer of a `temporary_path` name; None for any other name."""
    name = Path(path).name
    if not name.startswith(".") or TEMPORARY_MARK not in name:
        return None
    host, _, rest = name.rsplit(TEMPORARY_MARK, 1)[1].rpartition("-")[0].rpartition("-")
    return (host, int(rest)) if host and rest.isdigit() else None


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file or directory to stable storage (a directory: its entries, i.e. renames).

    Best effort: some file systems refuse to open or fsync a directory.
    """
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(temporary: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make a finished, closed temporary file the final one: fsync it, rename it over `final`,
    fsync the directory."""
    fsync_path(temporary)
    os.replace(temporary, final)
    fsync_path(Path(final).parent)


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike, mode: str = "wb", **open_options) -> Iterator[IO]:
    """An open temporary file for `final`; committed when the block completes, removed when it
    raises. The parent directory is created when missing."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(final)
    try:
        with open(temporary, mode, **open_options) as handle:
            yield handle
        commit(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """A temporary path for a writer that opens files itself (e.g. a plotting library's save);
    committed to `final` when the block completes, removed when it raises."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(final)
    try:
        yield temporary
        commit(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically: readers see the old content or the new."""
    with atomic_file(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dump_options) -> None:
    """`obj` as JSON (indent 2 unless given) with a final newline, written atomically."""
    write_text(path, json.dumps(obj, **({"indent": 2} | dump_options)) + "\n")


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, *, overwrite: bool) -> Iterator[Path]:
    """A fresh directory beside `final` to build an output in; renamed to `final` when the
    block completes, removed when it raises. An existing non-empty `final` is refused unless
    `overwrite`, and is then replaced only at the last step."""
    out = Path(final)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace)")
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(out)
    temporary.mkdir()  # not mkdtemp: that would leave the final directory mode 0700
    try:
        yield temporary
        _replace_directory(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _replace_directory(temporary: Path, out: Path) -> None:
    """Move the finished `temporary` to `out`, replacing whatever was there at the last step."""
    for entry in temporary.iterdir():
        if entry.is_file():
            fsync_path(entry)
    fsync_path(temporary)
    aside = None
    if out.exists():
        aside = temporary_path(out.with_name(out.name + ".old"))
        os.replace(out, aside)
    os.replace(temporary, out)
    fsync_path(out.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
