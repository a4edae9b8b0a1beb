"""The multi-process harness itself: every rank runs, collectives work, failures surface."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed


def _all_reduce(rank, world_size, tmp):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_rank_one(rank, world_size, tmp):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _crashes_on_rank_one(rank, world_size, tmp):
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a native crash ends a rank
    return rank


def _environment(rank, world_size, tmp):
    import os

    return os.environ.get("PIPE_HARNESS_CHECK"), os.getcwd()


@pytest.mark.dist
def test_ranks_see_the_test_process_environment_and_directory(tmp_path, monkeypatch):
    """Ranks are forked from a fork server started earlier, yet see what the test set just now."""
    run_distributed(_all_reduce, 2, tmp_path / "start")  # the fork server is running by now
    monkeypatch.setenv("PIPE_HARNESS_CHECK", "set by the test")
    monkeypatch.chdir(tmp_path)
    expected = ("set by the test", str(tmp_path))
    assert run_distributed(_environment, 2, tmp_path / "env") == [expected, expected]


@pytest.mark.dist
def test_harness_runs_every_rank_and_reports_failures(tmp_path):
    assert run_distributed(_all_reduce, 2, tmp_path / "a") == [3.0, 3.0]
    with pytest.raises(AssertionError, match="(?s)rank 1 failed.*boom on rank 1"):
        run_distributed(_fails_on_rank_one, 2, tmp_path / "b")


@pytest.mark.dist
def test_a_rank_that_crashes_is_told_at_once(tmp_path):
    """A rank killed by a signal (gloo's transport thread has segfaulted once in CI) fails the
    test with the rank and the signal, without waiting out the harness's timeout."""
    with pytest.raises(AssertionError, match=r"rank 1 died before reporting \(killed by SIGSEGV\)"):
        run_distributed(_crashes_on_rank_one, 2, tmp_path / "c")
