"""Save a training state as a DCP checkpoint and commit it atomically.

Order on disk, all inside `iter_XXXXXXX.tmp-<hex>/`: DCP shards and `.metadata` (fsynced by
DCP's writer), then `pipe_metadata.json` with per-file sizes and SHA-256 and `"complete": true`
(fsynced), then the directory is renamed to `iter_XXXXXXX`, then `latest` is replaced through
a temporary file. A crash at any point leaves the previous checkpoint and tracker untouched;
the leftover `.tmp-` directory is never loaded. Old checkpoints are rotated out only after that.

Works in one process without a process group (CPU tests, conversion tools) and with one, where
every rank writes its own shards into the same directory and rank 0 commits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.checkpoint.integrity import file_record
from pipeline.checkpoint.layout import (
    DCP_METADATA,
    FORMAT_NAME,
    FORMAT_VERSION,
    PIPE_METADATA,
    CheckpointError,
    committed_iterations,
    iteration_dir_name,
    read_tracker,
    temporary_dir_name,
    write_tracker,
)
from pipeline.checkpoint.rng import capture_rng_state
from pipeline.checkpoint.safe_reader import dcp_error
from pipeline.checkpoint.state import resolve_stateful, split_state
from pipeline.common.atomic import fsync_path, write_json
from pipeline.common.quiet import ignore_dcp_single_process_warning


def _dist_context(process_group: Any | None) -> tuple[bool, int, int]:
    """(distributed?, rank, world size) for `process_group` (default group when None)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False, 0, 1
    return True, dist.get_rank(process_group), dist.get_world_size(process_group)


def _broadcast_name(name: str, distributed: bool, process_group: Any | None) -> str:
    """Every rank must write into the same temporary directory: take rank 0's name."""
    if not distributed:
        return name
    import torch.distributed as dist

    holder = [name]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(holder, src=src, group=process_group)
    return holder[0]


def _gather(value: Any, distributed: bool, process_group: Any | None) -> list[Any]:
    """`[value of rank 0, value of rank 1, ...]` (in memory between ranks, never on disk)."""
    if not distributed:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, value, group=process_group)
    return gathered


def _own_file_records(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Hash this rank's shard files, so ranks share the hashing work of a large checkpoint."""
    prefix = f"__{rank}_"
    return {
        entry.name: file_record(entry)
        for entry in directory.iterdir()
        if entry.name.startswith(prefix) and entry.is_file()
    }


def _write_pipe_metadata(directory: Path, record: dict[str, Any]) -> None:
    """Write the completion record last; its presence with `complete: true` marks the commit."""
    write_json(directory / PIPE_METADATA, record, indent=1, sort_keys=True)


def _move_into_place(temporary: Path, final: Path) -> None:
    """Rename the finished directory to its final name, replacing a same-iteration one."""
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.trash-{uuid.uuid4().hex[:12]}")
        os.replace(final, aside)
    os.replace(temporary, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def rotate(save_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` committed checkpoints; returns what was deleted.

    The checkpoint `latest` points at is always kept. Each victim is first renamed to a
    `.trash-` name (atomic), so a crash mid-delete never leaves a half-deleted `iter_` dir.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(save_dir)
    iterations = committed_iterations(root)
    try:
        protected = read_tracker(root)
    except CheckpointError:
        protected = None
    deleted = []
    for iteration in iterations[:-keep_last]:
        victim = root / iteration_dir_name(iteration)
        if protected is not None and victim.name == protected.name:
            continue
        trash = victim.with_name(f"{victim.name}.trash-{uuid.uuid4().hex[:12]}")
        os.replace(victim, trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(victim)
    for leftover in root.glob("iter_*.trash-*"):  # from an earlier crash mid-delete
        shutil.rmtree(leftover, ignore_errors=True)
    return deleted


class _SaveJob:
    """Everything a save needs after DCP has written its files: the commit step."""

    def __init__(
        self,
        save_dir: Path,
        iteration: int,
        temporary: Path,
        record: dict[str, Any],
        keep_last: int | None,
        process_group: Any | None,
    ) -> None:
        self.save_dir = save_dir
        self.iteration = iteration
        self.temporary = temporary
        self.record = record
        self.keep_last = keep_last
        self.process_group = process_group

    def commit(self) -> Path:
        """Checksums, completion record, rename, tracker, rotation (rank 0; others wait)."""
        distributed, rank, _ = _dist_context(self.process_group)
        records = _gather(_own_file_records(self.temporary, rank), distributed, self.process_group)
        final = self.save_dir / iteration_dir_name(self.iteration)
        failure: BaseException | None = None
        if rank == 0:
            try:
                self._commit_on_coordinator(records, final)
            except BaseException as error:  # re-raised below, after the other ranks learn of it
                failure = error
        # Doubles as the closing barrier: every rank learns whether the commit happened.
        outcome = _gather(
            None if failure is None else str(failure), distributed, self.process_group
        )
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise CheckpointError(f"commit of {final} failed on rank 0: {outcome[0]}")
        return final

    def _commit_on_coordinator(self, records: list[dict[str, Any]], final: Path) -> None:
        """Rank 0: record every file's size and SHA-256, mark complete, rename, track, rotate."""
        files: dict[str, dict[str, Any]] = {}
        for rank_records in records:
            files.update(rank_records)
        for entry in self.temporary.iterdir():
            if entry.name not in files and entry.is_file():
                files[entry.name] = file_record(entry)
        if DCP_METADATA not in files:
            raise CheckpointError(f"{self.temporary}: DCP wrote no {DCP_METADATA}")
        record = dict(self.record, files=files, complete=True)
        _write_pipe_metadata(self.temporary, record)
        fsync_path(self.temporary)
        _move_into_place(self.temporary, final)
        write_tracker(self.save_dir, final.name)
        if self.keep_last is not None:
            rotate(self.save_dir, self.keep_last)


def _dcp_result(future: Any, temporary: Path) -> None:
    """Wait for DCP's write; its failures (BaseException subclasses) become CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        future.result()
    except CheckpointException as error:
        raise CheckpointError(f"writing checkpoint {temporary} failed: {error}") from error


class AsyncSave:
    """Handle of a checkpoint being written in the background.

    `save` returns it once every tensor is staged (copied to CPU memory), so training may
    change the parameters at once. DCP writes the files on a thread of its own (at a lower CPU
    priority, see `BACKGROUND_NICENESS`), and that thread then commits (checksums,
    `pipe_metadata.json`, rename, `latest`, rotation). With a process group, all of that
    thread's collectives (DCP's and the commit's) go over a gloo group reserved for background
    saves, issued in the same order on every rank, so they never interleave with the training
    thread's collectives and the commit needs nothing from the training thread of any rank.
    Call `wait()` before the next save and before exiting.
    """

    def __init__(self, dcp_future: Any, job: _SaveJob, started: float) -> None:
        self._job = job
        self._started = started
        self.seconds: float | None = None
        """Seconds from the call of `save` to the commit, once committed."""
        self._committed: concurrent.futures.Future[Path] = concurrent.futures.Future()
        dcp_future.add_done_callback(self._commit_when_written)

    @property
    def directory(self) -> Path:
        """The final directory the checkpoint gets when committed."""
        return self._job.save_dir / iteration_dir_name(self._job.iteration)

    def _commit_when_written(self, future: Any) -> None:
        try:
            _dcp_result(future, self._job.temporary)
            final = self._job.commit()
            self.seconds = time.monotonic() - self._started
            self._committed.set_result(final)
        except BaseException as error:  # handed to wait()
            self._committed.set_exception(error)

    def done(self) -> bool:
        """True once the checkpoint is committed (or failed); `wait()` will not block."""
        return self._committed.done()

    def wait(self) -> Path:
        """Block until committed; returns the final directory or raises the save's error."""
        return self._committed.result()


def new_background_group(process_group: Any | None = None) -> Any | None:
    """A new gloo group over the ranks of `process_group` for background saves (None without
    a process group). A collective: every rank of the default group must call it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    return dist.new_group(ranks=sorted(ranks), backend="gloo")


BACKGROUND_NICENESS = 10
"""How much the background writer lowers its CPU priority (Linux `nice`), so that on a busy
machine it takes the cores training leaves idle instead of slowing the steps down."""


def _lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority (per-thread on Linux; elsewhere unchanged)."""
    if sys.platform.startswith("linux"):
        # A sandbox may refuse setpriority: then the write runs at normal priority.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


def _start_async_write(tensors: dict[str, Any], writer: Any, group: Any) -> Any:
    """Stage `tensors` (a CPU copy, taken before returning, so training may then change them)
    and write the copy with DCP on a low-priority thread; returns that write's future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))  # synchronous copy
    staged = stager.stage(tensors)
    stager.close()  # forgets its cache of copies; `staged` lives on until written
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="pipe-checkpoint", initializer=_lower_thread_priority
    )
    future = pool.submit(
        dcp.save, staged, storage_writer=writer, process_group=group, no_dist=group is None
    )
    pool.shutdown(wait=False)  # the thread ends after this one write
    return future


def _uncommitted_record(
    iteration: int,
    world_size: int,
    metadata: dict[str, Any],
    json_leaves: Any,
    rng: list[Any] | None,
) -> dict[str, Any]:
    """The `pipe_metadata.json` record of a checkpoint being written (`complete` is false until
    the commit); `CheckpointError` when it is not JSON."""
    import torch

    record = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "iteration": iteration,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "world_size": world_size,
        "metadata": metadata,
        "non_tensor_state": json_leaves,
        "rng": rng,
    }
    try:
        json.dumps(record, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {error}") from error
    return record


def save(
    save_dir: str | os.PathLike,
    iteration: int,
    state: dict[str, Any],
    metadata: dict[str, Any] | None = None,
    keep_last: int | None = None,
    async_save: bool = False,
    *,
    process_group: Any | None = None,
    save_rng: bool = True,
    planner: Any | None = None,
    background_group: Any | None = None,
) -> Path | AsyncSave:
    """Write `state` as checkpoint `iteration` under `save_dir` and commit it atomically.

    `state` maps names to Stateful objects or nested dicts of tensors (DTensors included).
    Non-tensor leaves that are JSON values go to `pipe_metadata.json`; anything else is an
    error. `metadata` (JSON: iteration, consumed samples, scheduler, data blend, tokenizer,
    model config, parallel layout...) is stored as given and returned by `load`. RNG states
    of every rank are recorded unless `save_rng` is False. `planner` is a DCP save planner
    (e.g. one that streams tensors from elsewhere; synchronous saves only). Returns the
    committed directory, or an `AsyncSave` handle when `async_save` is true; with a process
    group, such a save runs its collectives on `background_group` (one from
    `new_background_group`, reused across saves; a new one is made when None).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    started = time.monotonic()
    ignore_dcp_single_process_warning()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(save_dir)
    distributed, rank, world_size = _dist_context(process_group)
    tensors, json_leaves = split_state(resolve_stateful(state))
    rng = _gather(capture_rng_state(), distributed, process_group) if save_rng else None
    record = _uncommitted_record(iteration, world_size, metadata or {}, json_leaves, rng)
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / _broadcast_name(temporary_dir_name(iteration), distributed, process_group)
    # DCP's writer keeps every tensor of a file alive until the file is closed; a streaming
    # planner (whose tensors exist one at a time) gets one file per item instead.
    writer = dcp.FileSystemWriter(temporary, sync_files=True, single_file_per_rank=planner is None)
    if async_save:
        if planner is not None:
            raise ValueError("a custom planner needs a synchronous save")
        if distributed and background_group is None:
            background_group = new_background_group(process_group)
        job = _SaveJob(root, iteration, temporary, record, keep_last, background_group)
        return AsyncSave(_start_async_write(tensors, writer, background_group), job, started)
    job = _SaveJob(root, iteration, temporary, record, keep_last, process_group)
    try:
        dcp.save(
            tensors,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=not distributed,
        )
    except CheckpointException as error:
        # DCP's exception derives from BaseException; turn it into an ordinary, named error
        # (a source's own CheckpointError, e.g. a damaged input shard, passes through as is).
        raise dcp_error(error, f"writing checkpoint {temporary}") from None
    return job.commit()
