"""The shared layer: atomic writes (one temporary scheme, fsync of file and folder, nothing left
on failure), hashing, progress bars; and that every writer of pipe goes through it."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np
import pytest

from pipeline.common import atomic
from pipeline.common.hashing import hash_stream, sha256_file, sha256_file_and_size
from pipeline.common.progress import byte_progress


@pytest.fixture
def fsynced(monkeypatch) -> list[Path]:
    """Every path os.fsync is called on, in order (the file descriptor's target, Linux only)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the file descriptors fsync is called on")
    seen: list[Path] = []
    real = os.fsync

    def record(fd: int) -> None:
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def _assert_durable(final: Path, fsynced: list[Path]) -> None:
    """`final` was fsynced under a temporary name of the one scheme, then its folder was."""
    temporaries = [p for p in fsynced if atomic.temporary_owner(p) is not None]
    assert any(p.name.startswith(f".{final.name}.tmp-") for p in temporaries), fsynced
    assert final.parent.resolve() in [p.resolve() for p in fsynced], fsynced
    assert final.is_file()
    leftovers = [p.name for p in final.parent.iterdir() if atomic.TEMPORARY_MARK in p.name]
    assert leftovers == []


def test_temporary_names_record_their_writer(tmp_path):
    name = atomic.temporary_path(tmp_path / "data.bin")
    assert name.parent == tmp_path and name.name.startswith(".data.bin.tmp-")
    host, pid = atomic.temporary_owner(name)
    assert pid == os.getpid() and host
    assert atomic.temporary_path(tmp_path / "data.bin") != name  # unique per call
    assert atomic.temporary_owner(tmp_path / "data.bin") is None


def test_atomic_file_commits_or_leaves_nothing(tmp_path, fsynced):
    final = tmp_path / "sub" / "out.txt"
    with atomic.atomic_file(final, "w", encoding="utf-8") as handle:
        handle.write("new")
        assert not final.exists()  # not under the final name until the block completes
    assert final.read_text() == "new"
    _assert_durable(final, fsynced)

    with pytest.raises(RuntimeError), atomic.atomic_file(final, "w") as handle:
        handle.write("half")
        raise RuntimeError("crash")
    assert final.read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["out.txt"]


def test_write_json_is_indented_with_a_final_newline(tmp_path):
    atomic.write_json(tmp_path / "a.json", {"b": 1})
    assert (tmp_path / "a.json").read_text() == '{\n  "b": 1\n}\n'


def test_staged_directory_replaces_only_at_the_end(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError), atomic.staged_directory(out, overwrite=False):
        pass
    with pytest.raises(RuntimeError), atomic.staged_directory(out, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    with atomic.staged_directory(out, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_sha256_of_files_ranges_and_streams(tmp_path):
    data = bytes(range(256)) * 1000
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(path, start=10, end=5000) == hashlib.sha256(data[10:5000]).hexdigest()
    assert sha256_file_and_size(path, start=255_990) == (
        hashlib.sha256(data[255_990:]).hexdigest(),
        10,
    )
    digest = hashlib.sha256()
    assert hash_stream(io.BytesIO(data), digest, 300) == 300
    assert digest.hexdigest() == hashlib.sha256(data[:300]).hexdigest()


def test_byte_progress_is_silent_when_quiet_or_not_a_terminal():
    with byte_progress(100, True, "x") as advance:
        assert advance is None
    with byte_progress(100, False, "x") as advance:  # pytest's stderr is not a terminal
        assert advance is None


# Every writer of pipe goes through the shared layer: its output is fsynced under the one
# temporary scheme and its folder is fsynced after the rename.


def test_train_config_toml_is_durable(tmp_path, fsynced):
    from pipeline.train.config.loader import save_config_toml
    from pipeline.train.config.schema import TrainConfig

    save_config_toml(TrainConfig(), tmp_path / "config.toml")
    _assert_durable(tmp_path / "config.toml", fsynced)


def test_preprocess_manifest_is_durable(tmp_path, fsynced):
    from pipeline.preprocess import manifest

    manifest.write(tmp_path / "m.json", {"complete": True})
    _assert_durable(tmp_path / "m.json", fsynced)


def test_indexed_dataset_and_sources_are_durable(tmp_path, fsynced):
    from pipeline.data.indexed import IndexedDatasetWriter
    from pipeline.data.sources import SourcesWriter

    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_document([1, 2, 3])
        writer.finalize()
    with SourcesWriter(tmp_path / "d") as sources:
        sources.add(0, np.array([1]))
        sources.finalize()
    for name in ("d.bin", "d.idx", "d.sources"):
        _assert_durable(tmp_path / name, fsynced)


def test_checkpoint_tracker_is_durable(tmp_path, fsynced):
    from pipeline.checkpoint.layout import write_tracker

    write_tracker(tmp_path, "iter_0000001")
    _assert_durable(tmp_path / "latest", fsynced)


def test_example_corpus_is_durable(tmp_path, fsynced):
    from pipeline.examples.stdlib_corpus import build_corpus

    assert build_corpus(tmp_path / "corpus.jsonl", max_documents=2) == 2
    _assert_durable(tmp_path / "corpus.jsonl", fsynced)
