"""The learning-rate scheduler that drives any optimizer's param groups along an `LRSchedule`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipeline.train.optimizers.schedules import LRSchedule

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["MegatronLR", "build_scheduler"]


class MegatronLR(LambdaLR):
    """`LambdaLR` driven by an `LRSchedule`; every param group gets `schedule.lr(step)`.

    Its state dict holds only the step count and learning rates (the schedule itself comes from
    the config, so a resumed run follows the config it was started with now), and loading one
    re-applies the learning rate at the loaded step so optimizer and scheduler agree at once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.schedule = schedule

        # A plain function, not a callable object: LambdaLR then leaves it out of state_dict().
        def factor(step: int) -> float:
            return schedule.factor(step)

        super().__init__(optimizer, lr_lambda=factor)

    def rewind(self, steps: int) -> None:
        """Take back the last `steps` steps (skipped optimizer steps, learnt at a log step):
        the learning rate returns to where the applied steps put it."""
        if steps <= 0:
            return
        self._set_step(self.last_epoch - steps)

    def _set_step(self, step: int) -> None:
        """Stand at `step`: every param group's learning rate is `schedule.lr(step)`."""
        self.last_epoch = step
        lrs = [base * self.schedule.factor(step) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("schedule", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The saving layout may have grouped the parameters differently (see `adamw.param_groups`).
        self.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self._set_step(self.last_epoch)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> MegatronLR:
    """The learning-rate scheduler for `cfg`; call `.step()` after each `optimizer.step()`."""
    return MegatronLR(optimizer, LRSchedule.from_config(cfg))
