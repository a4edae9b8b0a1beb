"""What `Trainer.train` carries from step to step, and what it returns.

`LogWindow` holds the steps since the last log line: their results stay on the device until a
log step reads them all at once (the one host sync between log steps). `LoopState` is one
`train` call's state (the result so far, the window, the progress bar); `TrainResult` is how
the call ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from pipeline.train.loop.train_step import StepResult

__all__ = ["LogWindow", "LoopState", "ReadStep", "TrainResult"]


class ReadStep(NamedTuple):
    """One step's results as read from the device."""

    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float | None
    """fp16: the loss scale the step ran with (None without one)."""


@dataclass
class TrainResult:
    """How `Trainer.train` ended."""

    iteration: int
    stop_reason: str
    """"finished", "evaluated" (`training.skip_train`), or the signal's name (SIGTERM, SIGINT)
    when stopped by one."""
    checkpoint: Path | None = None
    skipped: int = 0
    losses: dict[int, float] = field(default_factory=dict)


@dataclass
class LogWindow:
    """Training steps since the last log line. Their results stay on the device (`pending`)
    until `read_pending`, which fills `losses` and `grad_norms` (of the steps not skipped)."""

    pending: list[StepResult] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, result: StepResult, tokens: int, seconds: float) -> None:
        """Note a step (unread), the tokens it trained on and the seconds it took."""
        self.pending.append(result)
        self.tokens += tokens
        self.seconds += seconds

    def read_pending(self) -> list[ReadStep]:
        """Each pending step's loss, grad norm, skip flag and loss scale, read from the device
        in one go."""
        if not self.pending:
            return []
        rows = torch.stack([_step_row(s) for s in self.pending]).tolist()
        scaled = [s.loss_scale is not None for s in self.pending]
        self.pending = []
        out = [
            ReadStep(loss, norm, bool(skipped), scale if has_scale else None)
            for (loss, norm, skipped, scale), has_scale in zip(rows, scaled, strict=True)
        ]
        for loss, norm, skipped, _ in out:
            if not skipped:
                self.losses.append(loss)
                self.grad_norms.append(norm)
        return out

    def figures(self, flops_per_token: float, peak_tflops: float | None) -> dict[str, float]:
        """The window's read steps as logged: mean loss and gradient norm, tokens/s, model
        TFLOP/s and (with the device's peak) MFU."""
        seconds = max(self.seconds, 1e-9)
        tflops = flops_per_token * self.tokens / seconds / 1e12
        out = {
            "loss": float(np.mean(self.losses)) if self.losses else math.nan,
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else math.nan,
            "tokens_per_s": self.tokens / seconds,
            "tflops": tflops,
        }
        if peak_tflops is not None:
            out["mfu"] = tflops / peak_tflops
        return out


def _step_row(step: StepResult) -> torch.Tensor:
    """A step's loss, grad norm, skip flag and loss scale (NaN without one) as fp64 values."""
    device = step.loss.device
    scale = step.loss_scale if step.loss_scale is not None else torch.tensor(math.nan)
    values = (step.loss, step.grad_norm, step.skipped, scale)
    return torch.stack([v.double().to(device) for v in values])


@dataclass
class LoopState:
    """What one `Trainer.train` call carries from step to step: how the run is ending, the
    steps since the last log line, and the progress bar (None off rank 0 or a terminal)."""

    result: TrainResult
    window: LogWindow = field(default_factory=LogWindow)
    bar: Any = None

    def close(self) -> None:
        """Close the progress bar."""
        if self.bar is not None:
            self.bar.close()
