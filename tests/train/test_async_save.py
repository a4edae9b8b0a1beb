"""Asynchronous checkpoint saves in the trainer (`checkpoint.async_save = true`).

Training goes on while the files are written: a model whose save takes over a second takes
steps while its save is being written (what those steps cost is measured, not asserted, by
scripts/bench/async_save.py); kill -9 during the background write leaves the previous
checkpoint loadable; the next save, the end of training, SIGTERM and an error wait for the
background save to commit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import read_checkpoint_record, verify
from pipeline.checkpoint import saver as saver_module
from pipeline.checkpoint.layout import read_tracker
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import micro_sets, records, run_training_process

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
# The benchmark's settings (a model whose checkpoint takes over a second to write, a step a
# few tenths of a second on one thread) and its observed run, which sees a save as being
# written while the save's `.tmp-` directory exists (`writing_dirs`): from outside, so the run
# needs no help from the code under test.
from async_save import run_sets, timed_steps, writing_dirs  # noqa: E402

SAVE_AT = 8


def large_sets(run_dir: Path, *extra: str, iters: int) -> list[str]:
    """The benchmark's run: the large model on mock data, background saves every `SAVE_AT`."""
    return run_sets(run_dir, SAVE_AT, True, *extra, iters=iters)


def test_training_goes_on_while_a_background_save_is_written(tmp_path: Path) -> None:
    """Steps run while the save's files are being written, and the save commits whole.

    One torch thread leaves the second core of a 2-core machine to the writer. A blocking save
    would show no step starting or ending with the save's directory unfinished."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = timed_steps(tmp_path, SAVE_AT, async_save=True)
    finally:
        torch.set_num_threads(threads)
    during = [s for s in steps if s[1] or s[2]]
    saved = tmp_path / "checkpoints" / f"iter_{SAVE_AT:07d}"
    report = f"steps (start, save being written at start, at end): {steps}"
    assert len(during) >= 3, f"training did not go on while the save was written: {report}"
    assert not any(steps[SAVE_AT - 1][1:]), f"a save was in flight before it was due: {report}"
    assert verify(saved).ok and read_tracker(tmp_path / "checkpoints") == saved


def _last_logged_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first, or while a line is half-written)."""
    try:
        return max(records(run_dir), default=0)
    except (FileNotFoundError, ValueError):
        return 0


def _kill_during_second_write(proc, run_dir: Path) -> int:
    """Wait until the second save (iteration 2 * SAVE_AT) is being written while training has
    gone past it, then SIGKILL the run; returns that iteration."""
    save_dir, target = run_dir / "checkpoints", 2 * SAVE_AT
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no training step ran during the background write"
        writing = [d for d in writing_dirs(save_dir, target) if any(d.iterdir())]
        trained_on = _last_logged_step(run_dir) > target
        if writing and trained_on and not (save_dir / f"iter_{target:07d}").exists():
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
            return target
        time.sleep(0.02)


def test_sigkill_during_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """kill -9 while a background save is written and training has gone on: `latest` still
    names the previous checkpoint, which verifies and resumes; the killed save left only its
    `.tmp-` directory, nothing under a final name."""
    sets = ["--set=" + s for s in large_sets(tmp_path, iters=1000)]
    proc = run_training_process("from pipeline.train.commands import train; train()", *sets)
    try:
        killed_at = _kill_during_second_write(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    save_dir = tmp_path / "checkpoints"
    assert not (save_dir / f"iter_{killed_at:07d}").exists()
    assert writing_dirs(save_dir, killed_at), "the killed save's temporary directory is gone"
    previous = save_dir / f"iter_{SAVE_AT:07d}"
    assert read_tracker(save_dir) == previous
    assert [d.name for d in save_dir.glob("iter_*") if ".tmp-" not in d.name] == [previous.name]
    assert verify(previous).ok
    resumed = Trainer(
        resolve_config(
            None, large_sets(tmp_path / "resumed", f"checkpoint.load={save_dir}", iters=SAVE_AT)
        ),
        console=False,
    )
    assert resumed.iteration == SAVE_AT and resumed.consumed["train"] == SAVE_AT


@pytest.fixture
def slow_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Background saves of the micro model take at least half a second to commit."""
    commit = saver_module._SaveJob.commit

    def slowly(self):
        time.sleep(0.5)
        return commit(self)

    monkeypatch.setattr(saver_module._SaveJob, "commit", slowly)


def _micro_async(run_dir: Path, iters: int, save_interval: int) -> Trainer:
    sets = micro_sets(
        run_dir,
        "training.eval_interval=0",
        "checkpoint.async_save=true",
        f"checkpoint.save_interval={save_interval}",
        iters=iters,
    )
    return Trainer(resolve_config(None, sets), console=False)


def _interrupt_while_pending(trainer: Trainer, at: int, interrupt) -> None:
    """Call `interrupt()` before step `at + 1`, asserting a background save is then pending."""
    step = trainer.train_one_step

    def maybe_interrupt(iterator):
        if trainer.iteration == at:
            assert trainer.checkpoints.pending is not None, "the save was not in the background"
            interrupt()
        return step(iterator)

    trainer.train_one_step = maybe_interrupt


def _committed(save_dir: Path) -> list[str]:
    return sorted(d.name for d in save_dir.glob("iter_*") if verify(d).ok)


def test_an_error_waits_for_the_background_save(tmp_path: Path, slow_commit) -> None:
    trainer = _micro_async(tmp_path, iters=8, save_interval=2)

    def fail() -> None:
        raise RuntimeError("boom")

    _interrupt_while_pending(trainer, 2, fail)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert trainer.checkpoints.pending is None
    assert read_tracker(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "iter_0000002"
    assert _committed(tmp_path / "checkpoints") == ["iter_0000002"]


def test_sigterm_waits_for_the_background_save(tmp_path: Path, slow_commit) -> None:
    trainer = _micro_async(tmp_path, iters=8, save_interval=2)
    _interrupt_while_pending(trainer, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    result = trainer.train()
    assert result.stop_reason == "SIGTERM" and result.iteration == 3
    assert _committed(tmp_path / "checkpoints") == ["iter_0000002", "iter_0000003"]
    assert read_tracker(tmp_path / "checkpoints") == result.checkpoint


def test_end_of_training_waits_for_the_background_save(tmp_path: Path, slow_commit) -> None:
    """The last periodic save (at the last iteration) is in the background; `train` returns
    only once it is committed, and the next save waited for the one before it."""
    result = _micro_async(tmp_path, iters=4, save_interval=2).train()
    save_dir = tmp_path / "checkpoints"
    assert _committed(save_dir) == ["iter_0000002", "iter_0000004"]
    assert read_tracker(save_dir) == result.checkpoint == save_dir / "iter_0000004"
    assert read_checkpoint_record(result.checkpoint)["metadata"]["consumed_samples"] == 32
