"""The training loop waits for the device only on log steps: loss, gradient norm and skip flags
stay tensors between them (on a GPU each read is a host sync that stalls the launch queue).

On a CPU there is no device to wait for, so the test counts what would be a sync: every read of
a tensor's value into Python (`item`, `float`, `int`, `bool`, `tolist`, `numpy`, `__index__`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import micro_sets

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy", "__index__")


def _reads_per_iteration(monkeypatch, trainer: Trainer) -> list[int]:
    """Tensor reads made by each loop iteration of `trainer.train()` (from one step's start to
    the next's), counting every caller, torch's own included."""
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    starts = []
    step = trainer.train_one_step

    def counted_step(iterator):
        starts.append(count[0])
        return step(iterator)

    monkeypatch.setattr(trainer, "train_one_step", counted_step)
    trainer.train()
    return [after - before for before, after in zip(starts, starts[1:])]


def test_no_host_sync_between_log_steps(tmp_path: Path, monkeypatch) -> None:
    sets = micro_sets(
        tmp_path,
        "training.log_interval=4",
        "training.eval_interval=0",
        "checkpoint.save_interval=0",
        iters=8,
    )
    trainer = Trainer(resolve_config(None, sets), console=False)
    reads = _reads_per_iteration(monkeypatch, trainer)  # iterations 1..7
    log_step = reads[3]  # iteration 4: one read of the window's losses, norms and skip flags
    assert log_step >= 1
    # Iteration 1 is left out: the optimizer builds its state on its first step.
    assert {i: reads[i - 1] for i in (2, 3, 5, 6, 7)} == dict.fromkeys((2, 3, 5, 6, 7), 0)


@pytest.mark.parametrize("log_interval", [1, 3])
def test_skipped_step_holds_the_learning_rate_back(tmp_path: Path, log_interval) -> None:
    """A non-finite step leaves weights, optimizer state and the learning rate as they were,
    whether it is read at once (log every step) or at a later log step."""
    from tests.builders import nan_loss as _nan_loss

    sets = micro_sets(
        tmp_path / str(log_interval),
        "training.eval_interval=0",
        "checkpoint.save_interval=0",
        f"training.log_interval={log_interval}",
        iters=3,
        mbs=8,
    )
    clean = Trainer(resolve_config(None, sets), console=False)
    clean.train_one_step(iter(clean.train_loader))  # the one step the other run applies
    with pytest.MonkeyPatch.context() as mp:
        trainer = Trainer(resolve_config(None, sets), console=False)
        _nan_loss(mp, bad_calls={2, 3})  # iterations 2 and 3
        result = trainer.train()
    assert result.skipped == 2
    assert trainer.scheduler.last_epoch == clean.scheduler.last_epoch == 1
    assert trainer.scheduler.get_last_lr() == clean.scheduler.get_last_lr()
    for (name, p), q in zip(trainer.model.named_parameters(), clean.model.parameters()):
        assert torch.equal(p, q), name
    steps = {s["step"].item() for s in trainer.optimizer.state.values()}
    assert steps == {1.0}
