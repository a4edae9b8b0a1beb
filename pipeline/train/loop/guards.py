"""Run guards: skip optimizer steps whose loss or gradient norm is not finite, and turn
SIGTERM/SIGINT into "finish this step, save, exit".

Both only record what happened; the trainer decides what to do (skip, save, stop), so the
policy stays in one place and these classes are trivial to test.
"""

from __future__ import annotations

import math
import signal
import threading
from types import FrameType

__all__ = ["MAX_CONSECUTIVE_SKIPS", "NonFiniteGuard", "NonFiniteStop", "StopSignals"]

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

    def record_overflow(self) -> None:
        """Note a step skipped for an fp16 gradient overflow the loss scaler is still backing
        off from: counted in all, but neither a divergence nor the end of one."""
        self.total += 1

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
