"""`pipe inspect`: what an indexed dataset holds (counts, dtype, length distribution, manifest),
and optionally its first documents decoded."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.data import manifest as manifest_io
from pipeline.data.indexed import IndexedDataset
from pipeline.data.sources import read_sources

PERCENTILES = (0, 10, 50, 90, 99, 100)


def describe(prefix: str) -> dict[str, Any]:
    """Counts, dtype, length percentiles and a log2 histogram of sequence lengths."""
    ds = IndexedDataset(prefix)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    info: dict[str, Any] = {
        "prefix": ds.prefix,
        "dtype": ds.dtype.name,
        "sequences": len(ds),
        "documents": ds.num_documents,
        "empty_documents": int(np.count_nonzero(np.diff(ds.document_indices) == 0)),
        "tokens": int(lengths.sum()),
        "bin_bytes": int(lengths.sum()) * ds.dtype.itemsize,
    }
    if len(lengths):
        info["length_mean"] = float(lengths.mean())
        info["length_percentiles"] = {
            f"p{q}": int(v)
            for q, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES, method="lower"))
        }
        info["length_histogram"] = _log2_histogram(lengths)
    manifest_file = manifest_io.find_for_dataset(ds.prefix)
    if manifest_file is not None:
        info["manifest"] = {"path": str(manifest_file), **manifest_io.read(manifest_file)}
    return info


def _log2_histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Sequence counts per power-of-two length bucket [2^k, 2^(k+1))."""
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(buckets)
    return [
        {"min": 0 if k == 0 else 2**k, "max": 2 ** (k + 1) - 1, "count": int(c)}
        for k, c in enumerate(counts)
        if c
    ]


def format_description(info: dict[str, Any]) -> list[str]:
    """The report `pipe inspect` prints."""
    lines = [
        f"dataset    {info['prefix']}",
        f"dtype      {info['dtype']}",
        f"documents  {info['documents']:,} ({info['empty_documents']:,} empty)",
        f"sequences  {info['sequences']:,}",
        f"tokens     {info['tokens']:,} ({info['bin_bytes'] / 1e6:,.1f} MB in .bin)",
    ]
    if "length_percentiles" in info:
        pct = "  ".join(f"{k} {v:,}" for k, v in info["length_percentiles"].items())
        lines.append(f"length     mean {info['length_mean']:,.1f}  {pct}")
        hist = info["length_histogram"]
        widest = max(h["count"] for h in hist)
        lines.append("histogram of sequence lengths:")
        for h in hist:
            bar = "#" * max(1, round(40 * h["count"] / widest))
            lines.append(f"  {h['min']:>8,}-{h['max']:<8,} {h['count']:>10,} {bar}")
    if "manifest" in info:
        m = info["manifest"]
        tok = m.get("tokenizer", {})
        files = ", ".join(f["path"] for f in tok.get("files", []))
        lines.append(f"manifest   {m['path']}")
        lines.append(
            f"  tokenizer  {tok.get('kind')} ({tok.get('engine')}), vocab "
            f"{tok.get('vocab_size'):,}, eod {tok.get('eod')}: {files}"
        )
        lines.append(f"  flags      {m.get('flags')}")
        inputs = m.get("inputs", [])
        lines.append(
            f"  inputs     {len(inputs)} file(s), {sum(i['bytes'] for i in inputs) / 1e6:,.1f} MB"
        )
        lines += [f"    {i['path']} {_input_hash(i)}" for i in inputs[:5]]
        lines.append(f"  made by    pipe {m.get('tool', {}).get('version')} at {m.get('created')}")
    return lines


def _input_hash(entry: dict[str, Any]) -> str:
    """`sha256 0123...`, or for a file split between shards the number of hashed parts."""
    if "sha256" in entry:
        return f"sha256 {entry['sha256'][:16]}..."
    if "sha256_parts" in entry:
        return f"sha256 of {len(entry['sha256_parts'])} parts (split between shards)"
    return "(part of a sharded run: hashes in the shard's ranges)"


def decoded_documents(prefix: str, tokenizer: Any, count: int) -> list[str]:
    """The first `count` documents decoded with `tokenizer` (a TextTokenizer)."""
    ds = IndexedDataset(prefix)
    texts = []
    for i, tokens in enumerate(ds.documents()):
        if i >= count:
            break
        texts.append(tokenizer.decode(tokens.tolist()))
    return texts


def document_sources(prefix: str, info: dict[str, Any], count: int) -> list[str]:
    """`path:LINE` (`path row N` for tabular inputs) of the first `count` documents, from
    the sources file and the manifest's input list; [] when the dataset has no sources file."""
    rows = read_sources(IndexedDataset(prefix).prefix)
    if rows is None:
        return []
    inputs = info.get("manifest", {}).get("inputs", [])
    described = []
    for input_index, line in rows[:count].tolist():
        entry = inputs[input_index] if input_index < len(inputs) else {}
        path = entry.get("path", f"input {input_index}")
        jsonl = entry.get("kind", "jsonl").startswith("jsonl")
        described.append(f"{path}:{line}" if jsonl else f"{path} row {line}")
    return described
