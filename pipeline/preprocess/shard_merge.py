"""`pipe merge --shards PREFIX`: join the shards of a sharded `pipe preprocess` run into what one
machine would have written.

Before writing anything it checks that all N shards are there and finished (each one's manifest
says `complete`), that their manifests agree (tokenizer files, flags, input list, shard count) and
that each covered the ranges the partition gives it. Problems name the shard: "shard 2 of 7 is
missing". The merge concatenates each key's shards in shard order (Megatron's `add_index`), so
`{PREFIX}_{key}_document.bin/.idx` equal the unsharded run's byte for byte, and writes a manifest
`{PREFIX}.json` describing the whole run (a file split between shards is hashed per part).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from typing import Any

from pipeline.data.indexed import bin_path, dataset_exists, idx_path, normalize_prefix
from pipeline.data.manifest import manifest_path
from pipeline.data.manifest import read as read_manifest
from pipeline.data.sources import SourcesWriter, sources_path
from pipeline.preprocess import manifest as manifest_io
from pipeline.preprocess.inputs import InputFile
from pipeline.preprocess.merge import MergeError, merge
from pipeline.preprocess.shards import parse_shard_name, plan_shards, shard_prefix

MAX_BAD_LINE_EXAMPLES = 10


@dataclass
class ShardMergeSummary:
    output_prefix: str
    count: int
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> manifest entry
    manifest: str = ""


def merge_shards(
    specs: list[str], output_prefix: str | None = None, *, overwrite: bool = False
) -> ShardMergeSummary:
    """Check and merge the shards named by `specs` (a run's prefix, or its shard files)."""
    base = base_prefix(specs)
    count = shard_count(base)
    records = check_shards(base, count)
    out = normalize_prefix(output_prefix) if output_prefix else base
    keys = manifest_io.output_keys(records[0]["flags"])
    targets = [f"{out}_{key}_document" for key in keys]
    existing = [p for t in targets for p in (bin_path(t), idx_path(t)) if p.exists()]
    existing += [p for p in [manifest_path(out)] if p.exists()]
    if existing and not overwrite:
        raise MergeError(f"output exists: {existing[0]}; pass --overwrite to replace it")
    summary = ShardMergeSummary(out, count, manifest=str(manifest_path(out)))
    prefixes = [shard_prefix(base, i, count) for i in range(count)]
    for key, target in zip(keys, targets):
        parts = [f"{p}_{key}_document" for p in prefixes]
        if records[0]["flags"].get("record_sources"):
            _merge_sources(parts, target)
        summary.outputs[key] = _merge_key(parts, target)
    manifest_io.write(manifest_path(out), merged_manifest(records, prefixes, summary))
    return summary


def base_prefix(specs: list[str]) -> str:
    """The run prefix that `specs` name: given as is, or taken from shard file names (globs
    expanded). All specs must name the same run."""
    bases: list[str] = []
    for spec in specs:
        paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not paths:
            raise MergeError(f"{spec}: pattern matches nothing")
        for path in paths:
            parsed = parse_shard_name(path)
            base = parsed[0] if parsed else normalize_prefix(path)
            if base not in bases:
                bases.append(base)
    if len(bases) != 1:
        raise MergeError(f"--shards names several runs ({', '.join(bases)}); merge one at a time")
    return bases[0]


def shard_count(base: str) -> int:
    """N of the `{base}.shard-*-of-N*` files on disk (one N only)."""
    found = glob.glob(f"{glob.escape(base)}.shard-*-of-*")
    counts = sorted(
        {parsed[2] for p in found if (parsed := parse_shard_name(p)) and parsed[0] == base}
    )
    if not counts:
        raise MergeError(
            f"no shards found for prefix {base} (expected {shard_prefix(base, 0, 1)}* files, "
            "written by `pipe preprocess --num-shards N --shard-index I`)"
        )
    if len(counts) > 1:
        listing = ", ".join(map(str, counts))
        raise MergeError(
            f"{base}: shards of runs with different shard counts are mixed ({listing}); "
            "remove the stale ones"
        )
    return counts[0]


def check_shards(base: str, count: int) -> list[dict[str, Any]]:
    """Every shard's manifest record, after checking that all are present, complete and agree."""
    problems, records = [], []
    for index in range(count):
        record, problem = _shard_state(base, index, count)
        records.append(record)
        if problem:
            problems.append(f"shard {index} of {count} {problem}")
    if problems:
        raise MergeError("; ".join(problems) + " (rerun those shard indices, then merge)")
    _check_agreement(records, count)
    return records


def _shard_state(base: str, index: int, count: int) -> tuple[dict[str, Any], str]:
    """(manifest record, problem or "") of one shard."""
    prefix = shard_prefix(base, index, count)
    manifest = manifest_path(prefix)
    record = read_manifest(manifest)
    if record is None:
        if glob.glob(f"{glob.escape(prefix)}_*"):
            return {}, f"is incomplete (outputs but no manifest {manifest}: still running?)"
        return {}, f"is missing (no {manifest})"
    if not record.get("complete"):
        return record, f"failed: {record.get('error', 'no error recorded')} ({manifest})"
    keys = manifest_io.output_keys(record.get("flags") or {"json_keys": []})
    missing = [k for k in keys if not dataset_exists(f"{prefix}_{k}_document")]
    if missing:
        return record, f"is incomplete: {prefix}_{missing[0]}_document.bin/.idx is missing"
    return record, ""


def _check_agreement(records: list[dict[str, Any]], count: int) -> None:
    """Shards must share tokenizer, flags and inputs, and cover the ranges the plan gives them."""
    first = manifest_io.identity(records[0])
    inputs = [InputFile(i["path"], i["kind"], i["bytes"]) for i in records[0]["inputs"]]
    plan = plan_shards(inputs, count)
    for index, record in enumerate(records):
        found = manifest_io.identity(record)
        differ = [k for k in ("tokenizer", "flags", "inputs") if found[k] != first[k]]
        if differ:
            raise MergeError(
                f"shard {index} of {count} was made with a different {', '.join(differ)} "
                "than shard 0; rerun it with the same command"
            )
        expected = manifest_io.range_entries(inputs, plan[index])
        if found["shard"].get("ranges") != expected or found["shard"].get("count") != count:
            raise MergeError(f"shard {index} of {count} covered other input ranges than the plan")


def _merge_key(parts: list[str], target: str) -> dict[str, Any]:
    """Concatenate one key's shard datasets, in shard order, into `target` (the caller has
    already refused an existing output)."""
    merged = merge(parts, target, overwrite=True)
    return {
        "prefix": merged.output_prefix,
        "dtype": merged.dtype,
        "documents": merged.documents,
        "sequences": merged.sequences,
        "tokens": merged.tokens,
    }


def _merge_sources(parts: list[str], target: str) -> None:
    """Concatenate the shards' sources files (shards number inputs and lines alike)."""
    missing = [str(sources_path(p)) for p in parts if not sources_path(p).is_file()]
    if missing:
        raise MergeError(f"{missing[0]}: missing, though the run recorded sources")
    with SourcesWriter(target) as writer:
        for part in parts:
            writer.add_file(sources_path(part))
        writer.finalize()


def merged_manifest(
    records: list[dict[str, Any]], prefixes: list[str], summary: ShardMergeSummary
) -> dict[str, Any]:
    """The manifest of the whole run: shard 0's tokenizer and flags, every input with its hash
    (per part for a file split between shards), and the shards' counts added up."""
    counts: dict[str, int] = {}
    for record in records:
        for name, value in record.get("counts", {}).items():
            counts[name] = counts.get(name, 0) + value
    examples = [e for r in records for e in r.get("bad_line_examples", [])]
    return {
        **manifest_io.header(complete=True),
        "tokenizer": records[0]["tokenizer"],
        "inputs": _merged_inputs(records),
        "flags": records[0]["flags"],
        "outputs": summary.outputs,
        "counts": counts,
        "bad_line_examples": examples[:MAX_BAD_LINE_EXAMPLES],
        "elapsed_seconds": max(r.get("elapsed_seconds", 0.0) for r in records),
        "shards": {
            "count": summary.count,
            "manifests": [str(manifest_path(p)) for p in prefixes],
            "elapsed_seconds": [r.get("elapsed_seconds", 0.0) for r in records],
        },
    }


def _merged_inputs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    entries = [dict(i) for i in records[0]["inputs"]]
    parts: list[list[dict[str, Any]]] = [[] for _ in entries]
    for record in records:
        for r in record["shard"]["ranges"]:
            parts[r["input"]].append({"start": r["start"], "end": r["end"], "sha256": r["sha256"]})
    for entry, pieces in zip(entries, parts):
        if len(pieces) == 1 and pieces[0]["start"] == 0 and pieces[0]["end"] == entry["bytes"]:
            entry["sha256"] = pieces[0]["sha256"]
        else:
            entry["sha256_parts"] = pieces
    return entries
