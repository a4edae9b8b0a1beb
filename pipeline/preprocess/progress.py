"""Progress reporting for long preprocessing jobs: a tqdm bar on a terminal, plain periodic
lines otherwise (they read cleanly in CI and Slurm logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from pipeline.common.progress import terminal_bar


class Progress:
    """Tracks documents, tokens and bytes; shows rates and, when the input size is known, an ETA."""

    def __init__(
        self,
        total_bytes: int | None,
        *,
        stream: TextIO | None = None,
        log_interval: float = 10.0,
        enabled: bool = True,
    ):
        self.stream = stream or sys.stderr
        self.total_bytes = total_bytes or None
        self.log_interval = log_interval
        self.enabled = enabled
        self.start = time.perf_counter()
        self.documents = self.tokens = self.input_bytes = self.text_bytes = 0
        self._last_log = self.start
        self._bar = None
        if enabled:
            self._bar = terminal_bar(
                self.total_bytes, desc="preprocess", stream=self.stream, unit="B", unit_scale=True
            )

    def update(self, *, documents: int, tokens: int, input_bytes: int, text_bytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.input_bytes += input_bytes
        self.text_bytes += text_bytes
        if self._bar is not None:
            self._bar.update(input_bytes)
            self._bar.set_postfix_str(self._rates(), refresh=False)
        elif self.enabled and time.perf_counter() - self._last_log >= self.log_interval:
            self._last_log = time.perf_counter()
            print(
                f"[preprocess] {self.documents:,} docs, {self._rates()}{self._eta()}",
                file=self.stream,
                flush=True,
            )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _rates(self) -> str:
        t = max(self.elapsed, 1e-9)
        return (
            f"{self.documents / t:,.0f} docs/s, {self.text_bytes / t / 1e6:,.1f} MB/s, "
            f"{self.tokens / t:,.0f} tok/s"
        )

    def _eta(self) -> str:
        if not self.total_bytes or not self.input_bytes:
            return ""
        remaining = self.elapsed * (self.total_bytes - self.input_bytes) / self.input_bytes
        return f", {100 * self.input_bytes / self.total_bytes:.0f}%, ETA {remaining:,.0f}s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self) -> str:
        """One line for the end of the run."""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens, "
            f"{self.text_bytes / 1e6:,.1f} MB in {self.elapsed:,.1f}s ({self._rates()})"
        )
