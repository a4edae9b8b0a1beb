"""Integrity check of committed checkpoints: complete, every file intact, no shard missing.

A checkpoint passes when its `pipe_metadata.json` says `complete`, every file it lists exists
with the recorded size and SHA-256, no unlisted file sits beside them, and the set of DCP data
files equals the set DCP's own `.metadata` refers to (each item's byte range inside its file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checkpoint.layout import (
    DCP_METADATA,
    FORMAT_NAME,
    PIPE_METADATA,
    CheckpointError,
    parse_iteration_dir_name,
    read_pipe_metadata,
    read_tracker,
)
from pipeline.common.hashing import sha256_file_and_size


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """`{"size": bytes, "sha256": hex}` of one file, read in chunks."""
    sha256, size = sha256_file_and_size(path)
    return {"size": size, "sha256": sha256}


@dataclass
class CheckpointReport:
    """Outcome of verifying one checkpoint directory; `problems` name the bad files."""

    directory: Path
    iteration: int | None = None
    files: int = 0
    total_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        """One line: `OK dir (n files, size)` or `FAIL dir: first problem (+k more)`."""
        if self.ok:
            return f"OK   {self.directory} ({self.files} files, {self.total_bytes} bytes)"
        extra = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"FAIL {self.directory}: {self.problems[0]}{extra}"


def _check_dcp_files(directory: Path, listed: set[str], report: CheckpointReport) -> None:
    """Compare DCP's own view of its data files with what is on disk."""
    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    try:
        metadata = load_dcp_metadata(directory / DCP_METADATA)
    except (CheckpointError, OSError) as error:
        report.problems.append(str(error))
        return
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    data_files = {name for name in listed if name.endswith(".distcp")}
    for name in sorted(set(needed) - data_files):
        report.problems.append(f"{directory / name}: shard named in DCP metadata is missing")
    for name in sorted(data_files - set(needed)):
        report.problems.append(f"{directory / name}: shard not referenced by DCP metadata")
    for name, end in sorted(needed.items()):
        path = directory / name
        if path.is_file() and path.stat().st_size < end:
            report.problems.append(f"{path}: truncated (DCP items need {end} bytes)")


def verify(directory: str | os.PathLike) -> CheckpointReport:
    """Verify one checkpoint directory (`iter_XXXXXXX`); never raises for a bad checkpoint."""
    root = Path(directory)
    report = CheckpointReport(directory=root, iteration=parse_iteration_dir_name(root.name))
    if not root.is_dir():
        report.problems.append(f"{root}: no such checkpoint directory")
        return report
    record = read_pipe_metadata(root)
    if record is None:
        report.problems.append(f"{root / PIPE_METADATA}: missing or unreadable (incomplete save)")
        return report
    if record.get("format") != FORMAT_NAME:
        report.problems.append(f"{root / PIPE_METADATA}: format is {record.get('format')!r}")
    if record.get("complete") is not True:
        report.problems.append(f"{root / PIPE_METADATA}: not marked complete")
    report.iteration = record.get("iteration", report.iteration)
    files = record.get("files") or {}
    if DCP_METADATA not in files:
        report.problems.append(f"{root / PIPE_METADATA}: lists no {DCP_METADATA}")
    for name, expected in sorted(files.items()):
        path = root / name
        if not path.is_file():
            report.problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected.get("size"):
            report.problems.append(f"{path}: size {size} != recorded {expected.get('size')}")
            continue
        if file_record(path)["sha256"] != expected.get("sha256"):
            report.problems.append(f"{path}: SHA-256 mismatch (corrupt)")
            continue
        report.files += 1
        report.total_bytes += size
    present = {entry.name for entry in root.iterdir() if entry.name != PIPE_METADATA}
    for name in sorted(present - set(files)):
        report.problems.append(f"{root / name}: not listed in {PIPE_METADATA}")
    if (root / DCP_METADATA).is_file():
        _check_dcp_files(root, set(files) | present, report)
    return report


def verify_save_dir(
    path: str | os.PathLike, all_checkpoints: bool = False
) -> list[CheckpointReport]:
    """Verify an `iter_*` directory, or a save directory's latest (or every) checkpoint."""
    root = Path(path)
    if (root / PIPE_METADATA).exists() or parse_iteration_dir_name(root.name) is not None:
        return [verify(root)]
    if all_checkpoints:
        targets = sorted(
            entry
            for entry in root.iterdir()
            if entry.is_dir() and parse_iteration_dir_name(entry.name) is not None
        )
        if not targets:
            return [CheckpointReport(root, problems=[f"{root}: no iter_* checkpoints found"])]
        return [verify(target) for target in targets]
    try:
        latest = read_tracker(root)
    except CheckpointError as error:
        return [CheckpointReport(root, problems=[str(error)])]
    if latest is None:
        return [CheckpointReport(root, problems=[f"{root}: no 'latest' tracker file"])]
    return [verify(latest)]
