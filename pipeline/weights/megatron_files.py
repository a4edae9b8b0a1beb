"""The files of a megatron-core `torch_dist` checkpoint, read without running code from them:
the tracker and iteration directory, `metadata.json`, the DCP `.metadata` (Megatron pickles its
save plans into it, so the restricted unpickler admits those dataclasses too) and the training
`args` in `common.pt` or the `common_state` bytes item (`torch.load(weights_only=True)`)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.layout import CheckpointError
from pipeline.checkpoint.safe_reader import load_dcp_metadata

__all__ = [
    "TRACKER",
    "MegatronCheckpointError",
    "check_torch_dist",
    "find_iteration_dir",
    "load_megatron_metadata",
    "read_megatron_args",
]

TRACKER = "latest_checkpointed_iteration.txt"


class MegatronCheckpointError(CheckpointError):
    """The directory is not a torch_dist GPT checkpoint we can read, or disagrees with a config."""


def find_iteration_dir(directory: str | os.PathLike) -> tuple[Path, int | None]:
    """The iteration directory holding `.metadata`, and its iteration (None when unknown).

    `directory` is either a save directory with Megatron's `latest_checkpointed_iteration.txt`
    (an integer -> `iter_%07d`, or `release` -> `release/`) or an iteration directory itself.
    """
    path = Path(directory)
    if (path / ".metadata").is_file():
        match = re.fullmatch(r"iter_(\d+)", path.name)
        return path, int(match.group(1)) if match else (0 if path.name == "release" else None)
    tracker = path / TRACKER
    if not tracker.is_file():
        raise MegatronCheckpointError(
            f"{path}: neither a torch_dist iteration directory (.metadata) nor a save directory "
            f"({TRACKER})"
        )
    text = tracker.read_text().strip()
    if text == "release":
        iteration, iter_dir = 0, path / "release"
    elif text.isdigit():
        iteration, iter_dir = int(text), path / f"iter_{int(text):07d}"
    else:
        raise MegatronCheckpointError(
            f"{tracker}: expected an iteration or 'release', got {text!r}"
        )
    if not (iter_dir / ".metadata").is_file():
        raise MegatronCheckpointError(f"{iter_dir}: no .metadata (not a torch_dist checkpoint?)")
    return iter_dir, iteration


def check_torch_dist(iter_dir: Path) -> None:
    """Refuse incomplete saves (Megatron writes `metadata.json` last) and other backends."""
    marker = iter_dir / "metadata.json"
    if not marker.is_file():
        raise MegatronCheckpointError(
            f"{iter_dir}: no metadata.json (an incomplete save, or not a Megatron checkpoint)"
        )
    try:
        backend = json.loads(marker.read_text()).get("sharded_backend")
    except (ValueError, AttributeError) as error:
        raise MegatronCheckpointError(f"{marker}: unreadable ({error})") from error
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{iter_dir}: sharded_backend {backend!r}, not torch_dist")


class _Placeholder:
    """Stands in for Megatron's empty marker classes (`MCoreSavePlan`, `MCoreMetadata`)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


# Megatron pickles its save plans into `.metadata` (`all_local_plans`); these are plain DCP
# dataclasses and enums, so allowing them runs no checkpoint-chosen code.
_PLANNER_CLASSES = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}
_MCORE_MARKERS = {"MCoreSavePlan", "MCoreMetadata"}


def _megatron_classes(module: str, name: str) -> Any:
    """DCP's save-plan types and stand-ins for Megatron's markers; None for anything else."""
    if module == "torch.distributed.checkpoint.planner" and name in _PLANNER_CLASSES:
        from torch.distributed.checkpoint import planner

        return getattr(planner, name)
    if module.startswith("megatron.core.dist_checkpointing") and name in _MCORE_MARKERS:
        return _Placeholder
    return None


def load_megatron_metadata(path: str | os.PathLike) -> Any:
    """Unpickle a Megatron DCP `.metadata` safely. Non-tensor ("bytes") items such as TE's
    `_extra_state` are listed but never read (DCP would unpickle them without restriction)."""
    return load_dcp_metadata(path, extra_classes=_megatron_classes, allow_byte_items=True)


def read_megatron_args(iter_dir: Path, metadata: Any) -> dict[str, Any]:
    """Megatron's training `args` as a dict, or {} when the checkpoint holds none.

    mcore <= 0.18 writes them in `common.pt`; later versions in the DCP bytes item
    `common_state/shard_0_1`. Both are read with `torch.load(weights_only=True)`: besides
    `argparse.Namespace`, every other class the pickle names (Megatron enums and the like) is
    rebuilt as an inert `_Opaque` stand-in, so no checkpoint-chosen code runs and the plain
    values we need (ints, floats, strings, bools) come through.
    """
    common = iter_dir / "common.pt"
    blob = common.read_bytes() if common.is_file() else None
    if blob is None:
        blob = _read_bytes_item(iter_dir, metadata, "common_state/")
    if blob is None:
        return {}
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
        allowed: list[Any] = [argparse.Namespace]
        allowed += [(_Opaque, name) for name in names if name != "argparse.Namespace"]
        with torch.serialization.safe_globals(allowed):
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as error:  # not a zip-format torch.save, or something weights_only refuses
        warnings.warn(
            f"{iter_dir}: Megatron's common state is not readable with weights_only=True "
            f"({error}); inferring the config from shapes and the given model_config",
            stacklevel=3,
        )
        return {}
    if isinstance(state, list) and len(state) == 1:  # a ShardedObject payload
        state = state[0]
    args = state.get("args") if isinstance(state, dict) else None
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else {}


class _Opaque:
    """An inert stand-in for any class named in Megatron's common state other than Namespace."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _read_bytes_item(iter_dir: Path, metadata: Any, prefix: str) -> bytes | None:
    """The raw bytes of the first DCP bytes item whose key starts with `prefix`, or None."""
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefix):
            with open(iter_dir / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                return handle.read(info.length)
    return None
