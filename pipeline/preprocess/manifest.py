"""Writing the provenance manifest beside preprocessed data (`{output_prefix}.json`): which
tokenizer and inputs (with hashes) made the files, with which flags, and what they hold.
Reading it is `pipeline.data.manifest` (re-exported here)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import __version__
from pipeline.data.manifest import MANIFEST_FORMAT
from pipeline.preprocess.tokenizer import sha256_file

if TYPE_CHECKING:
    from pipeline.preprocess.readers import InputFile
    from pipeline.preprocess.runner import PreprocessConfig, PreprocessSummary
    from pipeline.preprocess.tokenizer import TextTokenizer


def hash_inputs(inputs: list[InputFile]) -> list[str]:
    """SHA-256 of each input (a dataset directory hashes its files in name order)."""
    return [_hash_path(Path(f.path)) for f in inputs]


def _hash_path(path: Path) -> str:
    if not path.is_dir():
        return sha256_file(path)
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def build(
    config: PreprocessConfig,
    tokenizer: TextTokenizer,
    inputs: list[InputFile],
    hashes: list[str],
    summary: PreprocessSummary,
) -> dict[str, Any]:
    """The manifest record of a finished run."""
    return {
        "format": MANIFEST_FORMAT,
        "tool": {"name": "pipe", "version": __version__},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tokenizer": tokenizer.fingerprint(),
        "inputs": [
            {"path": f.path, "kind": f.kind, "bytes": f.size, "sha256": h}
            for f, h in zip(inputs, hashes)
        ],
        "flags": {
            "json_keys": list(config.json_keys),
            "append_eod": config.append_eod,
            "add_special_tokens": tokenizer.add_special_tokens,
            "skip_bad_lines": config.skip_bad_lines,
            "level": "document",
        },
        "outputs": {
            o.key: {
                "prefix": o.prefix,
                "dtype": o.dtype,
                "documents": o.documents,
                "sequences": o.sequences,
                "tokens": o.tokens,
            }
            for o in summary.outputs
        },
        "counts": {
            "documents": summary.documents,
            "blank_lines": summary.blank_lines,
            "bad_lines": summary.bad_lines,
            "input_bytes": summary.input_bytes,
            "text_bytes": summary.text_bytes,
        },
        "bad_line_examples": [str(b) for b in summary.bad_line_examples],
        "elapsed_seconds": round(summary.elapsed, 3),
    }


def write(path: Path, record: dict[str, Any]) -> None:
    """Write atomically: a temporary file, then a rename."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
