"""On-disk layout of a checkpoint directory: names, the `latest` tracker, metadata reads.

A save directory looks like::

    {save_dir}/iter_0000100/            committed checkpoint: DCP files + pipe_metadata.json
    {save_dir}/iter_0000200.tmp-<hex>/  save in progress (or a crashed one): never loaded
    {save_dir}/latest                   tracker: the name of the newest committed iteration dir

This module knows names and files only; it never imports torch, so the CLI's help stays fast.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from pipeline.common.atomic import write_text

TRACKER = "latest"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
PIPE_METADATA = "pipe_metadata.json"
DCP_METADATA = ".metadata"
FORMAT_NAME = "pipe-dcp"
FORMAT_VERSION = 1

_ITER_RE = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or unsafe to load; the message names it."""


def iteration_dir_name(iteration: int) -> str:
    """`iter_0000100` for iteration 100 (Megatron's naming)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> int | None:
    """The iteration of a final `iter_XXXXXXX` name; None for anything else (e.g. `.tmp-` dirs)."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def temporary_dir_name(iteration: int) -> str:
    """A unique in-progress name next to the final one; renamed on commit."""
    return f"{iteration_dir_name(iteration)}.tmp-{uuid.uuid4().hex[:12]}"


def read_pipe_metadata(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed `pipe_metadata.json` of a directory, or None when it is absent or unreadable."""
    path = Path(directory) / PIPE_METADATA
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_complete(directory: str | os.PathLike) -> bool:
    """True when the directory holds metadata that says the save finished."""
    record = read_pipe_metadata(directory)
    return bool(record and record.get("complete") is True)


def committed_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations with a final-named, complete checkpoint directory, ascending."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        iteration = parse_iteration_dir_name(entry.name)
        if iteration is not None and entry.is_dir() and is_complete(entry):
            found.append(iteration)
    return sorted(found)


def read_tracker(save_dir: str | os.PathLike) -> Path | None:
    """The directory the tracker points at: `latest` (ours) or Megatron's iteration file.

    Returns None when neither tracker exists. Megatron's file holds an iteration number (or the
    word `release`); ours holds a directory name.
    """
    root = Path(save_dir)
    ours = root / TRACKER
    if ours.is_file():
        name = ours.read_text(encoding="utf-8").strip()
        if not name or "/" in name or name in (".", ".."):
            raise CheckpointError(f"tracker {ours} holds an invalid directory name {name!r}")
        return root / name
    megatron = root / MEGATRON_TRACKER
    if megatron.is_file():
        text = megatron.read_text(encoding="utf-8").strip()
        if text == "release":
            return root / "release"
        try:
            return root / iteration_dir_name(int(text))
        except ValueError as error:
            raise CheckpointError(f"tracker {megatron} holds {text!r}, not an iteration") from error
    return None


def write_tracker(save_dir: str | os.PathLike, dir_name: str) -> None:
    """Point `latest` at a committed iteration directory (temporary file + rename)."""
    write_text(Path(save_dir) / TRACKER, dir_name + "\n")
