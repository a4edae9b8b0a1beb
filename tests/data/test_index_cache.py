"""The index cache: hits map files without rebuilding, keys change when the indices would, a crash
mid-write never leaves a cache that loads, and concurrent builders build once."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import gpt_dataset
from pipeline.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from pipeline.data.index_cache import CacheNotWritableError, CacheWaitTimeout, IndexCache
from pipeline.data.indexed import IndexedDatasetWriter

NAMES = ("first", "second", "third")
DESCRIPTION = '{\n    "class": "Test"\n}'


def arrays() -> dict[str, np.ndarray]:
    return {
        "first": np.arange(10, dtype=np.int32),
        "second": np.arange(12, dtype=np.int64).reshape(6, 2),
        "third": np.zeros(0, dtype=np.uint32),
    }


def make_cache(directory, **kw) -> IndexCache:
    return IndexCache(directory, "0123abcd", "GPTDataset", "train", NAMES, **kw)


def assert_arrays_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype
        np.testing.assert_array_equal(actual[name], array)


# ----------------------------------------------------------------------------- one process


def test_hit_maps_files_without_building(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return arrays()

    first = make_cache(tmp_path).get_or_build(build, DESCRIPTION)
    second = make_cache(tmp_path).get_or_build(build, DESCRIPTION)
    assert len(calls) == 1
    assert_arrays_equal(first, arrays())
    assert_arrays_equal(second, arrays())
    for array in second.values():
        assert isinstance(array.base, np.memmap) and not array.flags.writeable
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "0123abcd-GPTDataset-train-description.txt",
        "0123abcd-GPTDataset-train-first.npy",
        "0123abcd-GPTDataset-train-second.npy",
        "0123abcd-GPTDataset-train-third.npy",
    ]
    assert (tmp_path / names[0]).read_text() == DESCRIPTION


def test_partial_or_foreign_cache_is_rebuilt(tmp_path):
    cache = make_cache(tmp_path)
    cache.write(arrays(), DESCRIPTION)
    cache.array_path("second").unlink()
    assert cache.load() is None
    assert_arrays_equal(cache.get_or_build(arrays, DESCRIPTION), arrays())
    # A description that differs from the dataset's is a miss, not a silent reuse.
    assert cache.load("something else") is None


def test_pickled_arrays_are_never_loaded(tmp_path, caplog):
    cache = make_cache(tmp_path)
    cache.write(arrays(), DESCRIPTION)
    np.save(cache.array_path("first"), np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with caplog.at_level(logging.WARNING):
        assert cache.load() is None
    assert "cannot read cached index" in caplog.text


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CacheNotWritableError, match="--data-cache-path"):
        make_cache(blocker / "cache").get_or_build(arrays, DESCRIPTION)


def test_stale_lock_of_a_silent_host_is_broken(tmp_path, caplog):
    cache = make_cache(tmp_path, stale_lock_s=60)
    lock = {"host": "another-host", "pid": 1, "time": time.time() - 3600}
    cache.lock_path.write_text(json.dumps(lock))
    os.utime(cache.lock_path, (time.time() - 3600, time.time() - 3600))
    with caplog.at_level(logging.WARNING):
        assert_arrays_equal(cache.get_or_build(arrays, DESCRIPTION), arrays())
    assert "broke the stale cache lock" in caplog.text
    assert not cache.lock_path.exists()


def test_live_lock_times_out_with_a_clear_error(tmp_path):
    cache = make_cache(tmp_path, wait_timeout_s=0.3, poll_s=0.05)
    cache.lock_path.write_text(json.dumps({"host": "another-host", "pid": 1, "time": time.time()}))
    with pytest.raises(CacheWaitTimeout, match=r"another-host.*delete the lock file"):
        cache.get_or_build(arrays, DESCRIPTION)


# ----------------------------------------------------------------------------- processes


class DieWhenSaved:
    """An array-like whose conversion kills the process: a crash in the middle of `np.save`."""

    def __array__(self, dtype=None, copy=None):
        os._exit(9)


def crash_while_writing(directory: str) -> None:
    make_cache(directory).get_or_build(
        lambda: {"first": np.arange(3), "second": np.arange(4), "third": DieWhenSaved()},
        DESCRIPTION,
    )


def build_concurrently(directory: str, counter: str, barrier, results) -> None:
    def build():
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that the other process must wait for the lock
        return arrays()

    barrier.wait()
    built = make_cache(directory, poll_s=0.02).get_or_build(build, DESCRIPTION)
    results.put({name: array.tolist() for name, array in built.items()})


def test_crash_mid_write_leaves_nothing_that_loads(tmp_path, caplog):
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=crash_while_writing, args=(str(tmp_path),))
    process.start()
    process.join(60)
    assert process.exitcode == 9
    cache = make_cache(tmp_path)
    assert cache.array_path("first").exists() and cache.lock_path.exists()
    assert not cache.description_path.exists()
    assert cache.load() is None
    with caplog.at_level(logging.WARNING):
        assert_arrays_equal(cache.get_or_build(arrays, DESCRIPTION), arrays())
    assert f"process {process.pid} on this host is gone" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_two_processes_build_once(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    counter = tmp_path / "builds.txt"
    processes = [
        context.Process(
            target=build_concurrently,
            args=(str(tmp_path / "cache"), str(counter), barrier, results),
        )
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    outputs = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    assert len(counter.read_text().splitlines()) == 1
    assert outputs[0] == outputs[1] == {k: v.tolist() for k, v in arrays().items()}


# ----------------------------------------------------------------------------- GPTDataset


@pytest.fixture()
def prefix(tmp_path) -> str:
    rng = np.random.default_rng(0)
    path = str(tmp_path / "corpus")
    with IndexedDatasetWriter(path, np.uint16) as writer:
        for _ in range(60):
            writer.add_document(rng.integers(0, 500, int(rng.integers(1, 30))))
        writer.finalize()
    return path


def config(**kw) -> GPTDatasetConfig:
    return GPTDatasetConfig(sequence_length=8, eod_id=0, tokenizer_id="t", split="1,1,1", **kw)


@pytest.fixture()
def count_builds(monkeypatch) -> list:
    calls: list = []
    real = gpt_dataset.build_sample_index

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(gpt_dataset, "build_sample_index", counting)
    return calls


def test_gpt_dataset_cache_hit_does_not_rebuild(prefix, count_builds):
    first = build_gpt_datasets(prefix, config(), [40, 10, None])
    assert len(count_builds) == 3
    cache_dir = Path(prefix) / "cache" / "GPTDataset_indices"
    assert len(list(cache_dir.glob("*-GPTDataset-*-description.txt"))) == 3
    second = build_gpt_datasets(prefix, config(), [40, 10, None])
    assert len(count_builds) == 3
    for a, b in zip(first, second):
        assert isinstance(b.sample_index.base, np.memmap)
        for i in range(len(a)):
            np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])


@pytest.mark.parametrize(
    ("change", "rebuilt"),
    [
        ({"add_extra_token_to_sequence": False}, 3),
        ({"drop_last_partial_validation_sequence": False}, 1),  # only valid's indices change
        ({"reset_position_ids": True, "eod_mask_loss": True}, 0),
    ],
)
def test_gpt_dataset_key_changes_only_with_the_indices(prefix, count_builds, change, rebuilt):
    build_gpt_datasets(prefix, config(), [40, 10, 10])
    build_gpt_datasets(prefix, config(**change), [40, 10, 10])
    assert len(count_builds) == 3 + rebuilt


def test_unwritable_default_directory_builds_in_memory(tmp_path, prefix, caplog):
    for suffix in (".bin", ".idx"):
        os.link(prefix + suffix, str(tmp_path / "blocked") + suffix)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the default cache directory would go")
    with caplog.at_level(logging.WARNING):
        datasets = build_gpt_datasets(str(blocked), config(), [10, None, None])
    assert len(datasets[0]) >= 10
    assert "--data-cache-path" in caplog.text and "in memory" in caplog.text
    with pytest.raises(CacheNotWritableError, match="--data-cache-path"):
        build_gpt_datasets(prefix, config(path_to_cache=str(blocked / "c")), [10, None, None])
