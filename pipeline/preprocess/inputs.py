"""Input discovery for `pipe preprocess`: turn command-line specs (files, globs, directories
written by `datasets`' `save_to_disk`) into `InputFile`s of a known kind, and the `InputRange`
of a file that a sharded run reads. Nothing here reads documents: `readers.py` does.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["InputError", "InputFile", "InputRange", "resolve_inputs"]

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
