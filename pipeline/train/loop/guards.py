"""Run guards: skip optimizer steps whose loss or gradient norm is not finite, and turn
SIGTERM/SIGINT into "finish this step, save, exit".

Both only record what happened; the trainer decides what to do (skip, save, stop), so the
policy stays in one place and these classes are trivial to test.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.train.loop.loop_state import ReadStep
    from pipeline.train.optimizers.loss_scaler import LossScaler

__all__ = ["MAX_CONSECUTIVE_SKIPS", "NonFiniteGuard", "NonFiniteStop", "StopSignals"]

log = logging.getLogger("pipeline.train")

MAX_CONSECUTIVE_SKIPS = 5
"""Non-finite steps in a row after which the run saves and stops (a diverged run)."""


class NonFiniteStop(RuntimeError):
    """Too many consecutive non-finite steps; the message names the step and the checkpoint."""


class NonFiniteGuard:
    """Counts steps skipped because their loss or gradient norm was NaN/Inf."""

    def __init__(self, max_consecutive: int = MAX_CONSECUTIVE_SKIPS) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    @staticmethod
    def is_finite(*values: float) -> bool:
        return all(math.isfinite(v) for v in values)

    def record(self, finite: bool) -> None:
        """Note one step's outcome; a finite step resets the consecutive count."""
        if finite:
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.total += 1

    def account(self, iteration: int, step: ReadStep, scaler: LossScaler | None) -> None:
        """Record a step read from the device and warn about a skipped one. An fp16 overflow
        (a finite loss) at a scale the dynamic loss scaler can still lower is expected: counted
        in all, but neither a divergence nor the end of one."""
        loss, norm, skipped, scale = step
        expected = (
            skipped
            and scaler is not None
            and scale is not None
            and math.isfinite(loss)
            and scaler.can_back_off(scale)
        )
        if expected:
            self.total += 1
            log.warning(
                "iteration %d: fp16 gradients overflowed at loss scale %g: step skipped "
                "(%d skipped in all)",
                iteration,
                scale,
                self.total,
            )
            return
        self.record(not skipped)
        if skipped:
            log.warning(
                "iteration %d: non-finite loss %s or grad norm %s: step skipped "
                "(%d in a row, %d in all)",
                iteration,
                loss,
                norm,
                self.consecutive,
                self.total,
            )

    @property
    def should_stop(self) -> bool:
        return self.consecutive >= self.max_consecutive


class StopSignals:
    """While installed, SIGTERM and SIGINT set `received` instead of killing the process.

    The trainer polls `received` after each step. A second SIGINT restores the default handler
    first, so pressing Ctrl-C twice still interrupts at once (e.g. a hung save).
    Handlers can only be installed from the main thread; elsewhere this is a no-op.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = signum

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
