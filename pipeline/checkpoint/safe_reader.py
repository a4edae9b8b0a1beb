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
from pipeline.checkpoint.verified_files import VerifiedFiles

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
    data: bytes | None = None,
) -> Any:
    """Unpickle a DCP `.metadata` file with the restricted unpickler; errors name the file.

    `extra_classes(module, name)` may admit more globals (return the object to use, or None
    to fall through to the allow-list), e.g. the save-plan types other writers pickle in.
    Non-tensor ("bytes") items are refused unless `allow_byte_items`: the caller then promises
    never to let DCP read them (DCP unpickles them without restriction). `data`: the file's
    bytes when the caller has read (and verified) them already.
    """
    with io.BytesIO(data) if data is not None else open(path, "rb") as handle:
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


def safe_file_system_reader(
    path: str | os.PathLike,
    metadata: Any = None,
    files: VerifiedFiles | None = None,
    *,
    finish_files: bool = False,
) -> Any:
    """A `FileSystemReader` for `path` whose `read_metadata` uses `load_dcp_metadata` (or
    returns `metadata` when the caller has already parsed it), and whose data reads go through
    `files` (a `VerifiedFiles`, hashing while reading; default: reading unverified), so a
    damaged shard is reported by name. `finish_files`: after a load, complete the hash of every
    data file this process verifies (one-shot loads; convert's reads finish files themselves).
    """
    parsed = metadata
    files = files if files is not None else VerifiedFiles(path, None)
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

        def read_data(self, plan: Any, planner: Any) -> Any:
            from torch.futures import Future

            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                name = self.storage_data[item.storage_index].relative_path
                per_file.setdefault(name, []).append(item)
            for name, items in per_file.items():
                items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
                path = files.directory / name
                for item in items:
                    info = self.storage_data[item.storage_index]
                    # Passed on, not kept: the item's bytes are freed as soon as they are parsed.
                    _load_item(
                        self, item, info, files.read(name, info.offset, info.length), planner, path
                    )
            if finish_files:
                for name in sorted({info.relative_path for info in self.storage_data.values()}):
                    files.finish(name)
            done: Future = Future()
            done.set_result(None)
            return done

    return SafeFileSystemReader(path)


def _load_item(reader: Any, item: Any, info: Any, data: bytes, planner: Any, path: Any) -> None:
    """Deserialise one DCP item from its bytes into the planner's target (tensors with
    `weights_only`); a damaged item is reported with its file and byte range."""
    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    stream = reader.transforms.transform_load_stream(
        item, info.transform_descriptors or (), io.BytesIO(data)
    )
    del data  # the stream holds the bytes until they are parsed
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(stream.read()))
        return
    try:
        seekable = stream if stream.seekable() else io.BytesIO(stream.read())
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        del stream, seekable  # before the target's pages are touched: peak stays at 2 copies
    except Exception as error:  # a corrupt zip or pickle: name the file, not torch's internals
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise CheckpointError(
            f"{path}: cannot read {item.dest_index.fqn} (bytes {info.offset}.."
            f"{info.offset + info.length}): {first_line}"
        ) from None
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(
            f"{path}: {item.dest_index.fqn} holds {tuple(tensor.size())}, "
            f"expected {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def dcp_error(error: BaseException, what: str) -> CheckpointError:
    """A one-line `CheckpointError` for a DCP load or save that failed (DCP wraps every rank's
    failure, with its traceback, in a `CheckpointException`): the `CheckpointError` a rank
    raised when there is one, else `what failed: <first failure>`."""
    first = None
    for failure in getattr(error, "failures", {}).values():
        exception = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exception, CheckpointError):
            return exception
        first = first or exception
    detail = f"{type(first).__name__}: {first}" if first is not None else type(error).__name__
    return CheckpointError(f"{what} failed: {detail}")
