"""Writing the provenance manifest beside preprocessed data (`{output_prefix}.json`): which
tokenizer and inputs (with hashes) made the files, with which flags, and what they hold.
Reading it is `pipeline.data.manifest` (re-exported here)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import __version__
from pipeline.common.atomic import write_json
from pipeline.common.hashing import sha256_file
from pipeline.data.manifest import MANIFEST_FORMAT

if TYPE_CHECKING:
    from pipeline.preprocess.inputs import InputFile, InputRange
    from pipeline.preprocess.runner import PreprocessConfig, PreprocessSummary
    from pipeline.preprocess.shards import ShardSpec
    from pipeline.tokenizer.tokenizer import TextTokenizer


def hash_inputs(parts: list[InputRange]) -> list[str]:
    """SHA-256 of each input part: a whole file (a dataset directory hashes its files in name
    order), or for a part of a split file the bytes [start, end) it owns."""
    return [
        _hash_path(Path(p.file.path))
        if p.is_whole
        else sha256_file(p.file.path, start=p.start, end=p.end)
        for p in parts
    ]


def _hash_path(path: Path) -> str:
    if not path.is_dir():
        return sha256_file(path)
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def flags(config: PreprocessConfig, tokenizer: TextTokenizer) -> dict[str, Any]:
    """The flags that decide the output bytes (shards to be merged must agree on them). A
    --chat run records its template (origin, SHA-256) and mask rule, and its output keys."""
    record = {
        "json_keys": list(config.input_keys),
        "append_eod": config.append_eod,
        "add_special_tokens": tokenizer.add_special_tokens,
        "skip_bad_lines": config.skip_bad_lines,
        "record_sources": config.record_sources,
        "level": "document",
    }
    if config.chat is not None:
        record["chat"] = config.chat.record()
        record["output_keys"] = list(config.output_keys)
        if config.preference:
            record["preference"] = True
    return record


def output_keys(flags: dict[str, Any]) -> list[str]:
    """The keys of a run's outputs (`{prefix}_{key}_document`), from its manifest's flags."""
    return list(flags.get("output_keys") or flags["json_keys"])


def header(complete: bool) -> dict[str, Any]:
    """The fields every manifest starts with: format, tool, creation time, completion."""
    return {
        "format": MANIFEST_FORMAT,
        "tool": {"name": "pipe", "version": __version__},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "complete": complete,
    }


def input_entries(inputs: list[InputFile]) -> list[dict[str, Any]]:
    """The manifest's `inputs` list, without hashes."""
    return [{"path": f.path, "kind": f.kind, "bytes": f.size} for f in inputs]


def input_positions(inputs: list[InputFile], parts: list[InputRange]) -> list[int]:
    """For each part, the position of its file in `inputs` (the run's whole input list)."""
    position = {id(f): i for i, f in enumerate(inputs)}
    return [position[id(p.file)] for p in parts]


def range_entries(inputs: list[InputFile], parts: list[InputRange]) -> list[dict[str, Any]]:
    """A shard's `ranges`: for each part, its input's position in `inputs`, path and bytes."""
    return [
        {"input": i, "path": p.file.path, "start": p.start, "end": p.end}
        for i, p in zip(input_positions(inputs, parts), parts)
    ]


def shard_record(
    shard: ShardSpec, output_prefix: str, inputs: list[InputFile], parts: list[InputRange]
) -> dict[str, Any]:
    """A shard's `shard` entry: which shard, of which run, and the input ranges it owns."""
    return {
        "index": shard.index,
        "count": shard.count,
        "source": shard.source,
        "output_prefix": output_prefix,
        "ranges": range_entries(inputs, parts),
    }


def identity(record: dict[str, Any]) -> dict[str, Any]:
    """What must match for two runs (or shards) to make the same bytes: tokenizer files (not
    their paths), flags, the input list and, for a shard, its place and ranges."""
    tokenizer = dict(record.get("tokenizer") or {})
    tokenizer["files"] = [(f.get("bytes"), f.get("sha256")) for f in tokenizer.get("files", [])]
    shard = {k: v for k, v in (record.get("shard") or {}).items() if k != "source"}
    if "ranges" in shard:
        shard["ranges"] = [{k: v for k, v in r.items() if k != "sha256"} for r in shard["ranges"]]
    return {
        "tokenizer": tokenizer,
        "flags": record.get("flags"),
        "inputs": [(i.get("path"), i.get("kind"), i.get("bytes")) for i in record["inputs"]],
        "shard": shard,
    }


def build(
    config: PreprocessConfig,
    tokenizer: TextTokenizer,
    inputs: list[InputFile],
    hashes: list[str],
    summary: PreprocessSummary,
    shard: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest record of a finished run. `hashes` are those of the run's parts: for an
    unsharded run one per input; for a shard one per entry of `shard["ranges"]`."""
    entries = input_entries(inputs)
    if shard is None:
        entries = [e | {"sha256": h} for e, h in zip(entries, hashes)]
    else:
        shard = {**shard, "ranges": [r | {"sha256": h} for r, h in zip(shard["ranges"], hashes)]}
    record = {
        **header(complete=True),
        "tokenizer": tokenizer.fingerprint(),
        "inputs": entries,
        "flags": flags(config, tokenizer),
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
            **({} if summary.loss_tokens is None else {"loss_tokens": summary.loss_tokens}),
        },
        "bad_line_examples": [str(b) for b in summary.bad_line_examples],
        "elapsed_seconds": round(summary.elapsed, 3),
    }
    if shard is not None:
        record["shard"] = shard
    return record


def failed(shard: dict[str, Any], error: str) -> dict[str, Any]:
    """The manifest a failed shard leaves, so that `pipe merge --shards` can say why."""
    return {
        **header(complete=False),
        "error": error,
        "shard": shard,
    }


def write(path: Path, record: dict[str, Any]) -> None:
    """Write atomically: a temporary file, then a rename."""
    write_json(path, record)
