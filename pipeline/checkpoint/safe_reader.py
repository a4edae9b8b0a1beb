"""Read DCP's `.metadata` without running code from the checkpoint.

torch 2.13's `FileSystemReader.read_metadata` calls plain `pickle.load` on `.metadata`, so a
crafted file could execute anything on load. `SafeFileSystemReader` reads it with an unpickler
that resolves only DCP's metadata dataclasses and the few torch/pathlib types they hold, and
refuses checkpoints with non-tensor ("bytes") items, which DCP would hand to `torch.load` without
`weights_only`. Tensor payloads are already read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

from pipeline.checkpoint.layout import DCP_METADATA, CheckpointError

_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


# A hook admitting more globals to the restricted unpickler: (module, name) -> object or None.
ExtraClasses = Callable[[str, str], Any]


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint's metadata refers to something outside DCP's metadata types."""


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only an allow-list of globals (plus torch dtypes)."""

    def __init__(
        self, file: io.BufferedIOBase, source: str, extra_classes: ExtraClasses | None = None
    ) -> None:
        super().__init__(file)
        self._source = source
        self._extra_classes = extra_classes

    def find_class(self, module: str, name: str) -> Any:
        if self._extra_classes is not None:
            found = self._extra_classes(module, name)
            if found is not None:
                return found
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            import torch

            candidate = getattr(torch, name, None)
            if isinstance(candidate, torch.dtype):
                return candidate
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to unpickle {module}.{name} "
            "(only DCP metadata types are allowed)"
        )


def load_dcp_metadata(
    path: str | os.PathLike,
    *,
    extra_classes: ExtraClasses | None = None,
    allow_byte_items: bool = False,
) -> Any:
    """Unpickle a DCP `.metadata` file with the restricted unpickler; errors name the file.

    `extra_classes(module, name)` may admit more globals (return the object to use, or None
    to fall through to the allow-list), e.g. the save-plan types other writers pickle in.
    Non-tensor ("bytes") items are refused unless `allow_byte_items`: the caller then promises
    never to let DCP read them (DCP unpickles them without restriction).
    """
    with open(path, "rb") as handle:
        try:
            metadata = _RestrictedUnpickler(handle, str(path), extra_classes).load()
        except UnsafeCheckpointError:
            raise
        except Exception as error:  # any corrupt pickle: report the file, not a pickle internal
            raise CheckpointError(f"{path}: unreadable DCP metadata ({error})") from error
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not a DCP Metadata object ({type(metadata).__name__})")
    byte_items = [
        key
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, BytesStorageMetadata)
    ]
    if byte_items and not allow_byte_items:
        raise UnsafeCheckpointError(
            f"{path}: non-tensor items {byte_items[:5]} would be read with pickle; refusing"
        )
    return metadata


def safe_file_system_reader(path: str | os.PathLike, metadata: Any = None) -> Any:
    """A `FileSystemReader` for `path` whose `read_metadata` uses `load_dcp_metadata`, or
    returns `metadata` when the caller has already parsed it (no file read per load)."""
    parsed = metadata
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader that never runs `pickle.load` on the checkpoint's metadata."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            metadata = parsed or load_dcp_metadata(os.path.join(self.path, name))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)
