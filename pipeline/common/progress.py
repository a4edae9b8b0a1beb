"""Progress bars for long commands: a tqdm bar on a terminal, nothing otherwise (logs and CI
get the command's own periodic lines instead)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


def terminal_bar(total: int | None, *, desc: str, stream: TextIO | None = None, **options):
    """A tqdm bar on `stream` (stderr by default) when it is a terminal, else None."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    from tqdm import tqdm

    size = shutil.get_terminal_size((100, 24))
    # A pty that reports a 0x0 size would otherwise hide the bar entirely.
    return tqdm(
        total=total, desc=desc, file=stream, ncols=size.columns, nrows=size.lines, **options
    )


@contextmanager
def byte_progress(total: int, quiet: bool, desc: str) -> Iterator[Callable[[int], object] | None]:
    """A byte-weighted bar on a terminal; yields its `advance(bytes)` function, or None when
    `quiet` or not on a terminal."""
    bar = None if quiet else terminal_bar(total, desc=desc, unit="B", unit_scale=True)
    try:
        yield (bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def increments(advance: Callable[[int], object] | None) -> Callable[[int], None] | None:
    """For a writer that reports bytes done so far (`write_hf`): a callback feeding the
    increments to `advance` (a bar's); None when there is no bar."""
    if advance is None:
        return None
    done = 0

    def report(total_done: int) -> None:
        nonlocal done
        advance(total_done - done)
        done = total_done

    return report
