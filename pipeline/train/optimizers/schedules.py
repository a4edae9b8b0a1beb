"""Learning-rate schedules, step for step as in Megatron-LM's `OptimizerParamScheduler.get_lr`.

With `s` the number of optimizer steps already taken (0 for the first update), `W` warmup_iters,
`D` decay_iters, `lr0` warmup_init_lr, and `max`/`min` the peak and final rates:

    warmup   (W > 0 and s <= W):  lr = lr0 + (max - lr0) * s / W
    constant (after warmup):      lr = max                       (for ever: `D` is ignored)
    past the decay (s > D):       lr = min
    otherwise, r = (s - W) / (D - W) and lr = min + c * (max - min) with
        linear:  c = 1 - r
        cosine:  c = 0.5 * (1 + cos(pi * r))
        wsd:     c = 1 while s <= D - Wd (Wd = wsd_decay_iters), then with q = (s - (D - Wd)) / Wd
                 linear: 1 - q;  cosine: 0.5 * (1 + cos(pi * q));
                 exponential: 2 * 0.5**q - 1;  minus_sqrt: 1 - sqrt(q)

So the first update of a run with warmup uses `lr0` (0 by default), the end of warmup uses `max`,
step `D` uses `min`, and every later step stays at `min`. Iteration `i` of the trainer (0-based)
uses `lr(i)`: Megatron steps its scheduler after each optimizer step, as torch's schedulers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["LRSchedule", "lr_at"]


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a function of the number of optimizer steps taken."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"
    warmup_init_lr: float = 0.0
    wsd_decay_iters: int | None = None
    wsd_decay_style: str = "linear"

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> LRSchedule:
        """The schedule a `TrainConfig` describes (decay_iters defaults to training.iters)."""
        s = cfg.scheduler
        return cls(
            max_lr=cfg.optimizer.lr,
            min_lr=cfg.optimizer.min_lr,
            warmup_iters=s.warmup_iters,
            decay_iters=cfg.decay_iters,
            decay_style=s.decay_style,
            warmup_init_lr=s.warmup_init_lr,
            wsd_decay_iters=s.wsd_decay_iters,
            wsd_decay_style=s.wsd_decay_style,
        )

    def lr(self, step: int) -> float:
        """Learning rate for the update made after `step` previous updates."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init_lr + (self.max_lr - self.warmup_init_lr) * (
                step / self.warmup_iters
            )
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = _cosine(ratio)
        elif self.decay_style == "wsd":
            coeff = self._wsd_coeff(step)
        else:
            raise ValueError(f"unknown decay_style {self.decay_style!r}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def factor(self, step: int) -> float:
        """`lr(step) / max_lr`: the multiplier a `torch.optim.lr_scheduler.LambdaLR` expects."""
        if self.max_lr == 0:
            return 0.0
        return self.lr(step) / self.max_lr

    def _wsd_coeff(self, step: int) -> float:
        if self.wsd_decay_iters is None:
            raise ValueError("decay_style wsd needs wsd_decay_iters")
        anneal_start = self.decay_iters - self.wsd_decay_iters
        if step <= anneal_start:
            return 1.0
        q = (step - anneal_start) / self.wsd_decay_iters
        style = self.wsd_decay_style
        if style == "linear":
            return 1.0 - q
        if style == "cosine":
            return _cosine(q)
        if style == "exponential":
            return 2.0 * 0.5**q - 1.0
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(q)
        raise ValueError(f"unknown wsd_decay_style {style!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of `cfg`'s schedule after `step` optimizer steps."""
    return LRSchedule.from_config(cfg).lr(step)


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)
