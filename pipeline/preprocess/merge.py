"""`pipe merge`: concatenate indexed datasets of one dtype, in order, into one.

The result is byte-identical to Megatron's `tools/merge_datasets.py` (IndexedDatasetBuilder
`add_index` + `finalize`): lengths and documents appended, pointers recomputed.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.indexed import (
    IndexedDatasetWriter,
    bin_path,
    dataset_exists,
    idx_path,
    normalize_prefix,
    read_index_header,
)


class MergeError(ValueError):
    """Inputs that cannot be merged; the message names the files."""


@dataclass
class MergeSummary:
    output_prefix: str
    inputs: list[str]
    dtype: str
    sequences: int
    documents: int
    tokens: int


def expand_inputs(specs: list[str]) -> list[str]:
    """Dataset prefixes from prefixes, `.bin`/`.idx` paths, globs and directories.

    A directory contributes every complete pair in it in sorted name order (as Megatron's
    merge_datasets.py); globs are sorted; repeats (a glob matching both `.bin` and `.idx`) collapse.
    """
    prefixes: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            files = glob.glob(os.path.join(spec, "*.bin"))
            names = sorted(normalize_prefix(p) for p in files)
            found = [n for n in names if dataset_exists(n)]
            if not found:
                raise MergeError(f"{spec}: directory holds no .bin/.idx pair")
        elif glob.has_magic(spec):
            found = [normalize_prefix(p) for p in sorted(glob.glob(spec))]
            if not found:
                raise MergeError(f"{spec}: pattern matches nothing")
        else:
            found = [normalize_prefix(spec)]
        prefixes += [p for p in found if p not in prefixes]
    for prefix in prefixes:
        for path in (bin_path(prefix), idx_path(prefix)):
            if not path.is_file():
                raise MergeError(f"{path}: not found (input dataset '{prefix}')")
    return prefixes


def merge(specs: list[str], output_prefix: str, *, overwrite: bool = False) -> MergeSummary:
    """Merge the datasets named by `specs` into `output_prefix`, refusing mixed dtypes."""
    prefixes = expand_inputs(specs)
    if not prefixes:
        raise MergeError("no input datasets given")
    output_prefix = normalize_prefix(output_prefix)
    if output_prefix in prefixes:
        raise MergeError(f"{output_prefix}: the output is also an input")
    existing = [p for p in (bin_path(output_prefix), idx_path(output_prefix)) if p.exists()]
    if existing and not overwrite:
        raise MergeError(f"output exists: {existing[0]}; pass --overwrite to replace it")
    headers = [(p, read_index_header(idx_path(p))) for p in prefixes]
    dtypes = {h.dtype for _, h in headers}
    if len(dtypes) > 1:
        listing = ", ".join(f"{idx_path(p)} ({h.dtype})" for p, h in headers)
        raise MergeError(f"cannot merge datasets of different dtypes: {listing}")
    dtype = headers[0][1].dtype
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
        summary = MergeSummary(
            output_prefix,
            prefixes,
            dtype.name,
            writer.num_sequences,
            writer.num_documents,
            writer.num_tokens,
        )
        writer.finalize()
    return summary
