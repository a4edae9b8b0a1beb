"""Load a committed checkpoint in place, refusing anything incomplete or unsafe.

The directory comes from an explicit iteration, from the `latest` tracker (or Megatron's
`latest_checkpointed_iteration.txt`), or is given directly. It must carry a complete
`pipe_metadata.json`; DCP's `.metadata` is read with a restricted unpickler. DCP re-shards on
load, so a checkpoint saved under one parallel layout loads under any other.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from pipeline.checkpoint.layout import (
    DCP_METADATA,
    PIPE_METADATA,
    CheckpointError,
    iteration_dir_name,
    read_pipe_metadata,
    read_tracker,
)
from pipeline.checkpoint.rng import restore_rng_state
from pipeline.checkpoint.safe_reader import (
    dcp_error,
    load_dcp_metadata,
    safe_file_system_reader,
)
from pipeline.checkpoint.state import (
    is_stateful,
    merge_json_leaves,
    resolve_stateful,
    split_state,
)
from pipeline.checkpoint.verified_files import VerifiedFiles, owner_of


def resolve_checkpoint_dir(load_dir: str | os.PathLike, iteration: int | None = None) -> Path:
    """The `iter_*` directory to load: given iteration, else the tracker's, else `load_dir`.

    `load_dir` may itself be a checkpoint directory. Raises `CheckpointError` naming the
    directory when it is missing or not a complete checkpoint.
    """
    return resolve_checkpoint(load_dir, iteration)[0]


def resolve_checkpoint(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> tuple[Path, dict[str, Any]]:
    """(the directory `resolve_checkpoint_dir` names, its whole `pipe_metadata.json`), the
    record read once."""
    root = Path(load_dir)
    if iteration is not None:
        target = root / iteration_dir_name(iteration)
    elif (root / PIPE_METADATA).exists():
        target = root
    else:
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root} does not exist")
        tracked = read_tracker(root)
        if tracked is None:
            raise CheckpointError(f"{root} has no 'latest' tracker and no iteration was given")
        target = tracked
    if not target.is_dir():
        raise CheckpointError(f"checkpoint {target} does not exist")
    record = read_pipe_metadata(target)
    if record is None or record.get("complete") is not True:
        raise CheckpointError(
            f"checkpoint {target} is incomplete (no complete {PIPE_METADATA}); "
            "it was probably interrupted while saving and will not be loaded"
        )
    return target, record


def read_checkpoint_record(directory: str | os.PathLike) -> dict[str, Any]:
    """The whole `pipe_metadata.json` of a complete checkpoint directory."""
    return resolve_checkpoint(directory)[1]


def verified_files(
    target: Path,
    record: dict[str, Any],
    verify: bool,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[VerifiedFiles, Any]:
    """The checkpoint's files read through a `VerifiedFiles` (checking the SHA-256 that
    `pipe_metadata.json` records while reading, unless not `verify`) and its DCP metadata,
    read and verified through them. With several ranks each data file is hashed by one rank
    (`owner_of`); every rank verifies the small `.metadata` it reads itself."""
    recorded = dict(record.get("files") or {}) if verify else None
    data_files = [name for name in (recorded or {}) if name.endswith(".distcp")]
    owners = owner_of(data_files, world_size)
    files = VerifiedFiles(target, recorded, owned=lambda name: owners.get(name, rank) == rank)
    metadata = load_dcp_metadata(target / DCP_METADATA, data=files.read_whole(DCP_METADATA))
    return files, metadata


def _read_tensors(
    target: Path,
    record: dict[str, Any],
    tensors: dict[str, Any],
    verify: bool,
    process_group: Any | None,
) -> None:
    """Fill `tensors` in place from checkpoint `target` through DCP (re-sharding as needed),
    every file checked against `record`'s SHA-256 unless not `verify`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world_size = dist.get_world_size(process_group) if distributed else 1
    # Read the DCP metadata ourselves first, so an unsafe file is refused with our error
    # rather than wrapped in DCP's rank-failure report.
    files, dcp_metadata = verified_files(target, record, verify, rank=rank, world_size=world_size)
    reader = safe_file_system_reader(target, dcp_metadata, files, finish_files=True)
    try:
        dcp.load(
            tensors, storage_reader=reader, process_group=process_group, no_dist=not distributed
        )
    except CheckpointException as error:
        raise dcp_error(error, f"loading checkpoint {target}") from None


def load(
    load_dir: str | os.PathLike,
    iteration: int | None = None,
    state: dict[str, Any] | None = None,
    *,
    process_group: Any | None = None,
    restore_rng: bool = True,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into `state` in place and return the metadata given to `save`.

    `state` has the same shape as at save time: Stateful objects (their `load_state_dict` is
    called with the loaded values) or nested dicts of pre-allocated tensors/DTensors, filled in
    place (use `load_model_and_optimizer_state` afterwards for a model + optimizer). Saved
    non-tensor leaves are put back into the dicts. RNG states are restored for this rank when
    `restore_rng`. The returned metadata always has `iteration`. Every file read is checked
    against the SHA-256 in `pipe_metadata.json` while it is read (each data file hashed by one
    rank), unless `verify_checksums` is False; a mismatch raises `CheckpointError` naming it.
    """
    import torch.distributed as dist

    target, record = resolve_checkpoint(load_dir, iteration)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    if state:
        resolved = resolve_stateful(state)
        tensors, _ = split_state(resolved)
        if tensors:
            _read_tensors(target, record, tensors, verify_checksums, process_group)
        merge_json_leaves(resolved, record.get("non_tensor_state") or [])
        for key, value in state.items():
            if is_stateful(value):
                value.load_state_dict(resolved[key])

    rng_states = record.get("rng")
    if restore_rng and rng_states:
        if rank < len(rng_states):
            restore_rng_state(rng_states[rank])
        else:
            warnings.warn(
                f"{target}: saved with {len(rng_states)} ranks; rank {rank} keeps its RNG state",
                stacklevel=2,
            )
    metadata = dict(record.get("metadata") or {})
    metadata.setdefault("iteration", record.get("iteration"))
    return metadata
