"""Reading the provenance manifest that `pipe preprocess` writes beside its datasets
(`{output_prefix}.json`): which tokenizer and inputs made a dataset. The writer lives in
`pipeline.preprocess.manifest`; readers (inspect, blend checks, training) use this module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = "pipe-preprocess-manifest/1"


def manifest_path(output_prefix: str) -> Path:
    return Path(f"{output_prefix}.json")


def find_for_dataset(prefix: str) -> Path | None:
    """The manifest of a dataset prefix such as `out/corpus_text_document` (-> `out/corpus.json`).

    Candidates are `{stem}.json` for each shorter `_`-separated stem; the one that records this
    dataset among its outputs wins. A manifest sits beside its datasets, so outputs are matched by
    file name: the same dataset named by an absolute or a relative path finds the same manifest.
    """
    stem = Path(prefix)
    parts = stem.name.split("_")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = stem.with_name("_".join(parts[:cut]) + ".json")
        record = read(candidate)
        outputs = (record or {}).get("outputs", {}).values()
        if any(Path(str(o.get("prefix"))).name == stem.name for o in outputs):
            return candidate
    return None


def read(path: Path) -> dict[str, Any] | None:
    """A manifest's record, or None when the file is absent or is not a pipe manifest."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == MANIFEST_FORMAT else None
