"""Tests for pipeline.preprocess.readers: resolving inputs and streaming them in batches."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import zstandard

from pipeline.preprocess import byte_streams
from pipeline.preprocess.readers import Batch, InputError, InputFile, iter_batches, resolve_inputs

DOCS = [{"text": f"document {i} " + "x" * (i % 37), "id": i} for i in range(300)]


def _jsonl_bytes(docs: list[dict], *, blank_every: int = 0, eol: bytes = b"\n") -> bytes:
    """Serialize docs as JSON lines, optionally with a blank line after every n-th doc."""
    out = []
    for i, d in enumerate(docs):
        out.append(json.dumps(d).encode() + eol)
        if blank_every and i % blank_every == blank_every - 1:
            out.append(eol)
    return b"".join(out)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _zst(data: bytes, frames: int = 1) -> bytes:
    """Compress data as `frames` concatenated zstd frames (with checksums, like the CLI)."""
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    step = -(-len(data) // frames)
    return b"".join(cctx.compress(data[i : i + step]) for i in range(0, len(data), step))


def _collect(inputs: list[InputFile], keys=("text",), **kw) -> list[Batch]:
    return list(iter_batches(inputs, list(keys), **kw))


def _lines(batches: list[Batch]) -> list[bytes]:
    return [ln for b in batches for ln in b.lines]


def _check_numbering(batches: list[Batch]) -> None:
    """Indices run 0.. over the run; first_line restarts at 1 per file and follows item counts."""
    assert [b.index for b in batches] == list(range(len(batches)))
    expected: dict[str, int] = {}
    for b in batches:
        items = b.lines if b.lines is not None else b.records
        assert b.first_line == expected.get(b.source, 1)
        expected[b.source] = b.first_line + len(items)


def _check_nbytes(batches: list[Batch], inputs: list[InputFile]) -> None:
    """nbytes are non-negative and sum, per file, to its size on disk."""
    assert all(b.nbytes >= 0 for b in batches)
    sums: dict[str, int] = {}
    for b in batches:
        sums[b.source] = sums.get(b.source, 0) + b.nbytes
    for inp in inputs:
        assert sums.get(inp.path, 0) == inp.size == _disk_size(inp.path)


def _disk_size(path: str) -> int:
    if os.path.isdir(path):
        return sum(p.stat().st_size for p in Path(path).glob("*.arrow"))
    return os.path.getsize(path)


# ---------------------------------------------------------------------------------------------
# JSONL kinds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "encode", "kind"),
    [
        ("a.jsonl", lambda b: b, "jsonl"),
        ("a.ndjson", lambda b: b, "jsonl"),
        ("a.jsonl.zst", _zst, "jsonl.zst"),
        ("a.zst", _zst, "jsonl.zst"),
        ("a.jsonl.gz", gzip.compress, "jsonl.gz"),
        ("a.gz", gzip.compress, "jsonl.gz"),
    ],
)
def test_jsonl_kinds_round_trip(tmp_path, name, encode, kind):
    raw = _jsonl_bytes(DOCS, blank_every=7)
    inputs = resolve_inputs([_write(tmp_path / name, encode(raw))])
    assert inputs == [InputFile(str(tmp_path / name), kind, os.path.getsize(tmp_path / name))]
    batches = _collect(inputs, batch_bytes=500, max_batch_items=10)
    assert len(batches) > 10
    assert _lines(batches) == raw.split(b"\n")[:-1]  # blank lines kept as b""
    assert all(b.records is None and b.source == inputs[0].path for b in batches)
    _check_numbering(batches)
    _check_nbytes(batches, inputs)


def test_line_numbers_point_at_the_right_lines(tmp_path):
    raw = _jsonl_bytes(DOCS, blank_every=5)
    inputs = resolve_inputs([_write(tmp_path / "a.jsonl", raw)])
    expected = raw.split(b"\n")
    for b in _collect(inputs, batch_bytes=300, max_batch_items=7):
        for offset, line in enumerate(b.lines):
            assert expected[b.first_line - 1 + offset] == line


def test_crlf_and_missing_final_newline(tmp_path):
    raw = b'{"text": "a"}\r\n\r\n{"text": "b"}\r\n{"text": "c"}'
    for name, data in [("a.jsonl", raw), ("a.jsonl.zst", _zst(raw)), ("a.gz", gzip.compress(raw))]:
        batches = _collect(resolve_inputs([_write(tmp_path / name, data)]))
        assert _lines(batches) == [b'{"text": "a"}', b"", b'{"text": "b"}', b'{"text": "c"}']


def test_mixed_line_endings_strip_only_one_cr(tmp_path):
    raw = b'{"text": "a"}\n{"text": "b"}\r\r\n{"text": "c"}\r\n'
    batches = _collect(resolve_inputs([_write(tmp_path / "a.jsonl", raw)]))
    assert _lines(batches) == [b'{"text": "a"}', b'{"text": "b"}\r', b'{"text": "c"}']


def test_trailing_newline_adds_no_line_and_empty_file_gives_nothing(tmp_path):
    one = _collect(resolve_inputs([_write(tmp_path / "a.jsonl", b"x\n")]))
    assert _lines(one) == [b"x"]
    assert _collect(resolve_inputs([_write(tmp_path / "e.jsonl", b"")])) == []
    blank = _collect(resolve_inputs([_write(tmp_path / "b.jsonl", b"\n\n")]))
    assert _lines(blank) == [b"", b""]


def test_empty_compressed_file_still_accounts_its_bytes(tmp_path):
    inputs = resolve_inputs([_write(tmp_path / "e.jsonl.gz", gzip.compress(b""))])
    batches = _collect(inputs)
    assert [(b.lines, b.nbytes) for b in batches] == [([], inputs[0].size)]


def test_invalid_utf8_passes_through_as_bytes(tmp_path):
    raw = b'{"text": "\xff\xfe"}\n{"text": "ok"}\n'
    batches = _collect(resolve_inputs([_write(tmp_path / "a.jsonl", raw)]))
    assert _lines(batches) == [b'{"text": "\xff\xfe"}', b'{"text": "ok"}']


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunk_boundaries_do_not_change_lines(tmp_path, monkeypatch, chunk):
    """Tiny read chunks put every boundary case (split CRLF, lines longer than a chunk) to work."""
    monkeypatch.setattr(byte_streams, "_READ_CHUNK", chunk)
    raw = b'{"t": 1}\r\n\n' + b"y" * 200 + b"\n\r\n" + _jsonl_bytes(DOCS[:20]) + b"last"
    expected = [ln.removesuffix(b"\r") for ln in raw.split(b"\n")]
    for name, data in [("a.jsonl", raw), ("a.jsonl.zst", _zst(raw, frames=3))]:
        inputs = resolve_inputs([_write(tmp_path / name, data)])
        batches = _collect(inputs, batch_bytes=100, max_batch_items=4)
        assert _lines(batches) == expected
        _check_numbering(batches)
        _check_nbytes(batches, inputs)


def test_multi_frame_zst(tmp_path):
    raw = _jsonl_bytes(DOCS)
    inputs = resolve_inputs([_write(tmp_path / "m.jsonl.zst", _zst(raw, frames=5))])
    batches = _collect(inputs, batch_bytes=2000)
    assert _lines(batches) == raw.splitlines()
    _check_nbytes(batches, inputs)


def test_zst_with_skippable_frame_and_no_checksum(tmp_path):
    raw = _jsonl_bytes(DOCS[:10])
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"hello"
    data = skippable + zstandard.ZstdCompressor(write_checksum=False).compress(raw)
    batches = _collect(resolve_inputs([_write(tmp_path / "s.zst", data)]))
    assert _lines(batches) == raw.splitlines()


# ---------------------------------------------------------------------------------------------
# Batch limits
# ---------------------------------------------------------------------------------------------


def test_max_batch_items(tmp_path):
    inputs = resolve_inputs([_write(tmp_path / "a.jsonl", _jsonl_bytes(DOCS))])
    batches = _collect(inputs, batch_bytes=1 << 30, max_batch_items=64)
    assert [len(b.lines) for b in batches] == [64] * 4 + [300 - 256]


def test_batch_bytes_closes_at_first_item_reaching_it(tmp_path):
    raw = _jsonl_bytes(DOCS)
    inputs = resolve_inputs([_write(tmp_path / "a.jsonl", raw)])
    limit = 1000
    batches = _collect(inputs, batch_bytes=limit, max_batch_items=1 << 20)
    for b in batches[:-1]:
        size = sum(len(ln) + 1 for ln in b.lines)  # a line counts with its newline
        assert size >= limit
        assert size - (len(b.lines[-1]) + 1) < limit
    assert sum(len(ln) + 1 for ln in batches[-1].lines) <= limit + 100


def test_single_line_bigger_than_batch_bytes(tmp_path):
    raw = b"a" * 5000 + b"\nb\n"
    batches = _collect(resolve_inputs([_write(tmp_path / "a.jsonl", raw)]), batch_bytes=10)
    assert [b.lines for b in batches] == [[b"a" * 5000], [b"b"]]


def test_bad_limits_rejected(tmp_path):
    inputs = resolve_inputs([_write(tmp_path / "a.jsonl", b"x\n")])
    with pytest.raises(ValueError):
        _collect(inputs, max_batch_items=0)


# ---------------------------------------------------------------------------------------------
# Several files
# ---------------------------------------------------------------------------------------------


def test_glob_expands_in_sorted_order_and_batches_never_span_files(tmp_path):
    for i in (3, 1, 2):
        _write(tmp_path / f"part-{i}.jsonl", _jsonl_bytes(DOCS[i * 10 : i * 10 + 25]))
    inputs = resolve_inputs([str(tmp_path / "part-*.jsonl")])
    assert [Path(i.path).name for i in inputs] == ["part-1.jsonl", "part-2.jsonl", "part-3.jsonl"]
    batches = _collect(inputs, max_batch_items=10)
    assert [len(b.lines) for b in batches] == [10, 10, 5] * 3
    assert [Path(b.source).name for b in batches[::3]] == [Path(i.path).name for i in inputs]
    _check_numbering(batches)
    _check_nbytes(batches, inputs)


def test_duplicates_kept_in_given_order(tmp_path):
    a = _write(tmp_path / "a.jsonl", b"1\n")
    b = _write(tmp_path / "b.jsonl", b"2\n")
    inputs = resolve_inputs([a, b, a, str(tmp_path / "*.jsonl")])
    assert [i.path for i in inputs] == [a, b, a, a, b]
    assert _lines(_collect(inputs)) == [b"1", b"2", b"1", b"1", b"2"]


# ---------------------------------------------------------------------------------------------
# Tabular kinds
# ---------------------------------------------------------------------------------------------


def _table_docs() -> list[dict]:
    return [{"text": d["text"], "id": d["id"], "meta": "m"} for d in DOCS]


def _write_parquet(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_table_docs()), path, row_group_size=70)
    return str(path)


def _write_arrow(path: Path, stream: bool) -> str:
    import pyarrow as pa

    table = pa.Table.from_pylist(_table_docs())
    with pa.OSFile(str(path), "wb") as f:
        writer = pa.ipc.new_stream(f, table.schema) if stream else pa.ipc.new_file(f, table.schema)
        writer.write_table(table, max_chunksize=90)
        writer.close()
    return str(path)


def _write_json(path: Path, array: bool) -> str:
    docs = _table_docs()
    text = json.dumps(docs) if array else "\n".join(json.dumps(d) for d in docs) + "\n"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("name", "writer", "kind"),
    [
        ("t.parquet", _write_parquet, "parquet"),
        ("t.arrow", lambda p: _write_arrow(p, stream=False), "arrow"),
        ("s.arrow", lambda p: _write_arrow(p, stream=True), "arrow"),
        ("a.json", lambda p: _write_json(p, array=True), "json"),
        ("l.json", lambda p: _write_json(p, array=False), "json"),
    ],
)
def test_tabular_kinds_round_trip(tmp_path, name, writer, kind):
    inputs = resolve_inputs([writer(tmp_path / name)])
    assert inputs[0].kind == kind
    batches = _collect(inputs, keys=("text", "id", "absent"), max_batch_items=32)
    assert all(b.lines is None and len(b.records) <= 32 for b in batches)
    records = [r for b in batches for r in b.records]
    assert records == [{"text": d["text"], "id": d["id"]} for d in DOCS]
    _check_numbering(batches)
    _check_nbytes(batches, inputs)


def test_tabular_batch_bytes_counts_text(tmp_path):
    inputs = resolve_inputs([_write_parquet(tmp_path / "t.parquet")])
    batches = _collect(inputs, batch_bytes=400, max_batch_items=1000)
    for b in batches[:-1]:
        text_bytes = sum(len(r["text"]) for r in b.records)
        assert text_bytes - len(b.records[-1]["text"]) < 400 <= text_bytes + 2 * len(b.records)


def _save_dataset(path: Path, *, dict_splits: tuple[str, ...] | None = None) -> str:
    import datasets

    ds = datasets.Dataset.from_list(_table_docs())
    if dict_splits is None:
        ds.save_to_disk(str(path), max_shard_size="10KB")
    else:
        datasets.DatasetDict({s: ds for s in dict_splits}).save_to_disk(str(path))
    return str(path)


def test_saved_dataset_dir(tmp_path):
    path = _save_dataset(tmp_path / "ds")
    inputs = resolve_inputs([path])
    assert inputs[0].kind == "hf_dataset" and inputs[0].path == path
    assert len(list(Path(path).glob("*.arrow"))) > 1  # several shards, sizes summed
    batches = _collect(inputs, keys=("text",), max_batch_items=50)
    assert [r for b in batches for r in b.records] == [{"text": d["text"]} for d in DOCS]
    _check_numbering(batches)
    _check_nbytes(batches, inputs)


def test_dataset_dict_dir_uses_train_split(tmp_path):
    path = _save_dataset(tmp_path / "dd", dict_splits=("train", "test"))
    inputs = resolve_inputs([path])
    assert inputs[0].kind == "hf_dataset" and inputs[0].path == os.path.join(path, "train")
    batches = _collect(inputs, keys=("id",), max_batch_items=100)
    assert [r["id"] for b in batches for r in b.records] == list(range(len(DOCS)))
    _check_nbytes(batches, inputs)


def test_dataset_dict_without_train_lists_splits(tmp_path):
    path = _save_dataset(tmp_path / "dd", dict_splits=("validation", "test"))
    with pytest.raises(InputError, match=r"dd.*validation, test"):
        resolve_inputs([path])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="nope.jsonl: no such file"):
        resolve_inputs([str(tmp_path / "nope.jsonl")])


def test_empty_glob_names_pattern(tmp_path):
    with pytest.raises(InputError, match=r"\*\.jsonl: no files match"):
        resolve_inputs([str(tmp_path / "*.jsonl")])


def test_unknown_suffix(tmp_path):
    with pytest.raises(InputError, match=r"a\.txt: unknown input format"):
        resolve_inputs([_write(tmp_path / "a.txt", b"x\n")])


def test_plain_directory_is_not_a_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="d: is a directory but not a dataset"):
        resolve_inputs([str(tmp_path / "d")])


def test_file_deleted_after_resolve(tmp_path):
    inputs = resolve_inputs([_write(tmp_path / "a.jsonl", b"x\n")])
    os.remove(inputs[0].path)
    with pytest.raises(InputError, match="a.jsonl: cannot open"):
        _collect(inputs)


def _corrupt(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :]


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("garbage.jsonl.zst", b"this is not zstd at all\n"),
        ("corrupt.jsonl.zst", _corrupt(_zst(_jsonl_bytes(DOCS) * 20))),
        ("truncated.jsonl.zst", _zst(_jsonl_bytes(DOCS) * 20, frames=2)[:-100]),
        ("cut_header.jsonl.zst", _zst(b"abc\n")[:3]),
        ("garbage.jsonl.gz", b"this is not gzip\n"),
        ("truncated.jsonl.gz", gzip.compress(_jsonl_bytes(DOCS))[:-50]),
        ("corrupt.jsonl.gz", _corrupt(gzip.compress(_jsonl_bytes(DOCS) * 20))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_damaged_compressed_file_names_it(tmp_path, name, data):
    inputs = resolve_inputs([_write(tmp_path / name, data)])
    with pytest.raises(InputError, match=rf"{name}: corrupt or truncated"):
        _collect(inputs)


@pytest.mark.parametrize(
    ("name", "data"),
    [("bad.parquet", b"not parquet"), ("bad.arrow", b"not arrow"), ("bad.json", b"[{oops")],
)
def test_damaged_tabular_file_names_it(tmp_path, name, data):
    inputs = resolve_inputs([_write(tmp_path / name, data)])
    with pytest.raises(InputError, match=rf"{name}: cannot read"):
        _collect(inputs)
