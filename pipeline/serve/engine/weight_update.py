"""New weights for the served model, in place, in the engine process.

They come from a pipe checkpoint or a Hugging Face directory on disk (opened as `pipe serve`
opens its model, `pipeline.serve.engine.loading.open_generator`), or from a training process on the
same machine that wrote tensors into one `multiprocessing.shared_memory` segment and named them,
with their dtypes, shapes and byte offsets (`pipeline.serve.http.weight_client.WeightClient.push`).
Every name, shape and byte range is checked before any tensor is copied, so a bad push is refused in
one line naming the tensor and the old weights keep serving. Names are the served model's own
(`Transformer.state_dict()`, as a pipe training process has them); a push may name a subset.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.cpu_linear import repack_linears
from pipeline.serve.engine.messages import UpdateWeights


class WeightUpdateError(ValueError):
    """New weights that do not fit the served model (one line naming the tensor or path)."""


def update_weights(model: Transformer, message: UpdateWeights) -> None:
    """Replace `model`'s weights with those `message` names (module docstring);
    `WeightUpdateError` before anything is changed when they do not fit."""
    if message.path is not None:
        copy_weights(model, disk_weights(model, message.path))
        return
    with attached(message.shm_name) as buffer:
        copy_weights(model, shared_weights(model, message, buffer))


def copy_weights(model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checked `tensors` into `model`'s parameters of the same names (cast to their dtype),
    then repack what was packed from the old weights."""
    params = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    repack_linears(model)


def disk_weights(model: Transformer, path: str) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint or Hugging Face directory at `path`, which must be the
    served model's architecture and size."""
    from pipeline.serve.engine.loading import LoadError, open_generator

    param = next(model.parameters())
    try:
        loaded = open_generator(path, device=param.device, dtype=param.dtype).model
    except LoadError as error:
        raise WeightUpdateError(str(error)) from None
    differ = [
        f.name
        for f in dataclasses.fields(model.config)
        if getattr(model.config, f.name) != getattr(loaded.config, f.name)
    ]
    if differ:
        raise WeightUpdateError(f"{path}: not the served model's configuration ({differ[0]})")
    tensors, params = loaded.state_dict(), model.state_dict()
    missing = [name for name in params if name not in tensors]
    if missing:
        raise WeightUpdateError(f"{path}: has no tensor {missing[0]}")
    for name, tensor in tensors.items():
        _check(params, name, tuple(tensor.shape))
    return tensors


def shared_weights(
    model: Transformer, message: UpdateWeights, buffer: memoryview
) -> dict[str, torch.Tensor]:
    """Views of the tensors `message` places in `buffer`, all checked before any is made."""
    params = model.state_dict()
    dtypes = []
    for name, dtype_name, shape, offset in _entries(message):
        _check(params, name, shape)
        dtype = _dtype(name, dtype_name)
        end = offset + _numel(shape) * dtype.itemsize
        if offset < 0 or end > len(buffer):
            raise WeightUpdateError(
                f"{name}: bytes {offset}..{end} lie outside the shared memory's {len(buffer)}"
            )
        dtypes.append(dtype)
    return {
        name: torch.frombuffer(buffer, dtype=dtype, count=_numel(shape), offset=offset).view(shape)
        for (name, _, shape, offset), dtype in zip(_entries(message), dtypes)
    }


def _entries(message: UpdateWeights) -> Iterator[tuple[str, str, tuple[int, ...], int]]:
    for name, dtype_name, shape, offset in zip(
        message.names, message.dtype_names, message.shapes, message.offsets
    ):
        yield name, dtype_name, tuple(shape), offset


def _check(params: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> None:
    target = params.get(name)
    if target is None:
        raise WeightUpdateError(
            f"{name}: the served model has no such tensor (its names are like {next(iter(params))})"
        )
    if shape != tuple(target.shape):
        raise WeightUpdateError(
            f"{name}: shape {list(shape)} does not fit the served model's {list(target.shape)}"
        )


def _dtype(name: str, dtype_name: str) -> torch.dtype:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"{name}: dtype {dtype_name!r} is not a torch dtype")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@contextmanager
def attached(name: str | None) -> Iterator[memoryview]:
    """The bytes of the shared-memory segment `name`, which its writer owns (and removes)."""
    from multiprocessing import resource_tracker, shared_memory

    try:
        segment = shared_memory.SharedMemory(name=name)
    except (FileNotFoundError, ValueError, TypeError):
        raise WeightUpdateError(f"shared memory {name!r}: no such segment") from None
    if sys.version_info < (3, 13):  # else this process's tracker would remove it at exit
        resource_tracker.unregister(segment._name, "shared_memory")
    try:
        yield segment.buf
    finally:
        segment.close()
