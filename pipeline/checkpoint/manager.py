"""`CheckpointManager`: the trainer's one object for periodic saves, rotation and resume.

It holds the save directory and policy (which iterations are due a save, how many to keep),
allows one background save at a time (a new save first waits for the pending one) and loads
from a separate directory when resuming elsewhere.
With a process group, background saves share one gloo group of their own (made on the first).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.checkpoint.layout import CheckpointError, read_tracker
from pipeline.checkpoint.loader import load
from pipeline.checkpoint.saver import AsyncSave, new_background_group, save


class CheckpointManager:
    """Save to `save_dir` every `save_interval` iterations (0: only when asked) keeping the last
    `keep_last`; load from `load_dir` (default: same), checking every file read against its
    recorded SHA-256 unless not `verify_checksums`."""

    def __init__(
        self,
        save_dir: str | os.PathLike,
        keep_last: int | None = None,
        async_save: bool = False,
        load_dir: str | os.PathLike | None = None,
        process_group: Any | None = None,
        verify_checksums: bool = True,
        save_interval: int = 0,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.save_interval = save_interval
        self.last_saved: int | None = None
        """The iteration this manager last saved (None before its first save)."""
        self.load_dir = Path(load_dir) if load_dir is not None else self.save_dir
        self.keep_last = keep_last
        self.async_save = async_save
        self.process_group = process_group
        self.verify_checksums = verify_checksums
        self._pending: AsyncSave | None = None
        self._background_group: Any | None = None

    def save_due(self, iteration: int) -> bool:
        """Whether `iteration` is one that `save_interval` saves."""
        return bool(self.save_interval) and iteration % self.save_interval == 0

    def saved(self, iteration: int) -> bool:
        """Whether this manager's last save was of `iteration`."""
        return self.last_saved == iteration

    def save(self, iteration: int, state: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Save (in the background when `async_save`), after finishing any pending save.

        A background save returns once its tensors are staged in memory: the caller may then
        change them. Every rank of a process group must call this at the same point."""
        self.wait()
        if self.async_save and self._background_group is None:
            self._background_group = new_background_group(self.process_group)
        result = save(
            self.save_dir,
            iteration,
            state,
            metadata,
            keep_last=self.keep_last,
            async_save=self.async_save,
            process_group=self.process_group,
            background_group=self._background_group,
        )
        self.last_saved = iteration
        if isinstance(result, AsyncSave):
            self._pending = result

    @property
    def pending(self) -> AsyncSave | None:
        """The background save `wait` has not collected yet (None when there is none); it
        commits on its own thread, so `pending.done()` tells without blocking or collectives."""
        return self._pending

    def wait(self) -> Path | None:
        """Finish the pending background save, if any; returns its directory."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def has_checkpoint(self) -> bool:
        """True when `load_dir` has a tracker to resume from."""
        try:
            return read_tracker(self.load_dir) is not None
        except CheckpointError:
            return False

    def load(self, state: dict[str, Any], iteration: int | None = None) -> dict[str, Any]:
        """Load the latest (or the given) checkpoint into `state`; returns its metadata."""
        self.wait()
        return load(
            self.load_dir,
            iteration,
            state,
            process_group=self.process_group,
            verify_checksums=self.verify_checksums,
        )
