"""GRPO hands the rollouts the policy's weights once per iteration they were generated at:
after each optimizer step, not again for every evaluation batch or for the step that follows
an evaluation at the same iteration."""

from __future__ import annotations

from pathlib import Path

from pipeline.train.objectives.grpo.objective import GRPO
from pipeline.train.objectives.grpo.rollout import RolloutModel
from tests.train.test_grpo import _train, grpo_sets, task  # noqa: F401


def test_rollouts_are_refreshed_once_per_iteration(monkeypatch, tmp_path: Path, task) -> None:  # noqa: F811
    refreshes, batches = [], []
    refresh, rollout_rows = RolloutModel.refresh, GRPO._rollout_rows

    def counted_refresh(self):
        refreshes.append(1)
        return refresh(self)

    def counted_rows(self, micro_batches, runner):
        batches.append((self.run.iteration, self._evaluating))
        return rollout_rows(self, micro_batches, runner)

    monkeypatch.setattr(RolloutModel, "refresh", counted_refresh)
    monkeypatch.setattr(GRPO, "_rollout_rows", counted_rows)
    sets = ("training.iters=2", "training.eval_interval=1", "training.eval_iters=2")
    assert _train(grpo_sets(tmp_path / "run", task, *sets)).stop_reason == "finished"
    # train at 0, evaluate twice at 1, train at 1, evaluate twice at 2
    assert batches == [(0, False), (1, True), (1, True), (1, False), (2, True), (2, True)]
    assert len(refreshes) == 3
