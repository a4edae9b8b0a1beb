"""Hugging Face weights into and out of the training model, under any parallel layout.

In: `load_hf_weights` fills this rank's materialised model parts (FSDP, TP, EP or pipeline
stages) from a Hugging Face directory read through `pipeline.weights` (`HFSource`): one full
tensor at a time is read and each rank keeps its shard of it (`copy_full_weights_`), so memory
stays near the largest tensor.

Out: `write_hf_from_model` writes the model as a Hugging Face directory with
`pipeline.weights.hf_writer`. `TrainedModelSource` is the model seen as a `TensorSource`: reading
a tensor gathers it (DTensor shards over their mesh, then, under pipeline parallelism, from the
stage that holds it to the first rank), so every rank must read the same tensors in the same
order. The first rank writes; the others make the same reads (`read_in_write_order`) and write
nothing. The directory appears under its final name only when complete.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.fsdp import copy_full_weights_
from pipeline.train.config.schema import ConfigError
from pipeline.weights.source import TensorInfo, TensorSource

__all__ = [
    "TrainedModelSource",
    "hf_checksum",
    "hf_directory",
    "load_hf_weights",
    "open_hf",
    "prune_rotated",
    "start_record",
    "tokenizer_mismatch",
    "tokenizer_record",
    "write_hf_from_model",
]

log = logging.getLogger("pipeline.train")

_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def _local_tensors(parts: list[Transformer]) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by their single-device names."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        persistent = set(part.state_dict(keep_vars=True))
        for name, tensor in itertools.chain(part.named_parameters(), part.named_buffers()):
            if name in persistent:
                out[name] = tensor
    return out


@torch.no_grad()
def load_hf_weights(
    parts: list[Transformer], source: TensorSource, skip: Callable[[str], bool] | None = None
) -> None:
    """Fill `parts` from `source`, one full tensor at a time; a weight the model has and the
    source lacks is a `ConfigError` naming it. `skip`: the model's tensors no Hugging Face
    model holds, left as they are (a LoRA run's adapters)."""
    tied = source.model_config.tie_word_embeddings
    names = list(source.tensors())
    provided = set(names) | ({"output.weight"} if tied else set())
    missing = sorted(n for n in set(_local_tensors(parts)) - provided if not (skip and skip(n)))
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{source.metadata.get('source')}: no weight {missing[0]}{more}")
    for name in names:
        tensor = source.read(name)
        if hasattr(source, "close"):
            source.close()  # unmapped: the pages read so far would otherwise stay resident
        full = {name: tensor}
        if tied and name == "tok_embeddings.weight":
            full["output.weight"] = tensor  # a pipeline's last stage holds its own copy
        for part in parts:
            copy_full_weights_(part, full)
        del tensor, full


def open_hf(directory: str | os.PathLike, what: str) -> Any:
    """The `HFSource` of a Hugging Face model directory, or one `ConfigError` line naming it
    (`what directory: why`) when it cannot be read as one."""
    from pipeline.weights.hf_reader import HFSource

    try:
        return HFSource(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {directory}: {' '.join(str(e).split())}") from None


def hf_checksum(source: Any, process_group: Any | None = None) -> str:
    """What identifies a Hugging Face model directory's weights (of an `HFSource`): the
    SHA-256 of a list of its `config.json`, its safetensors index (when it has one) and every
    weight file the source reads, each by name, size and the SHA-256 of all its bytes. Every
    byte is read once, at disk speed; under a process group the files are dealt out over the
    ranks and their hashes gathered, so every rank returns the same checksum."""
    from pipeline.common.hashing import sha256_file_and_size

    directory = source.directory
    index = directory / "model.safetensors.index.json"
    files = [directory / "config.json", *([index] if index.is_file() else [])]
    files += [f for f in source.weight_files if f not in files]
    rank, world = 0, 1
    if process_group is not None:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    names = [str(f.relative_to(directory)) for f in files]
    mine = {name: sha256_file_and_size(directory / name) for name in names[rank::world]}
    hashed = [mine]
    if world > 1:
        hashed = [None] * world
        dist.all_gather_object(hashed, mine, group=process_group)
    every = {name: entry for share in hashed for name, entry in share.items()}
    listing = [[name, every[name][1], every[name][0]] for name in names]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def tokenizer_record(data: dict[str, Any], hf_start: TensorSource | None) -> dict[str, Any]:
    """The run's tokenizer record: the data's ids (end of document, vocabulary), and the files
    of the Hugging Face model the run started from when it has any, so `pipe generate` and a
    Hugging Face save find them and their chat template."""
    hf_tokenizer = hf_start.metadata.get("tokenizer") if hf_start is not None else None
    if hf_tokenizer is None:
        return data
    return data | {"source": hf_tokenizer["source"], "fingerprint": hf_tokenizer["fingerprint"]}


def start_record(hf_start: TensorSource | None) -> dict[str, Any]:
    """What a checkpoint records of the Hugging Face model its run started from: where, and what
    a Hugging Face export writes back (architecture, dtype, bos/eos and end-of-turn ids)."""
    if hf_start is None:
        return {}
    from pipeline.weights.pipe_checkpoint import hf_record

    return {"converted_from": hf_start.metadata["source"], "hf": hf_record(hf_start.metadata)}


def hf_directory(save_dir: Path, iteration: int) -> Path:
    """Where `checkpoint.save_hf` writes the model of `iteration`: `<save>/hf/iter_XXXXXXX`."""
    return save_dir / "hf" / f"iter_{iteration:07d}"


def prune_rotated(save_dir: Path, current: int) -> None:
    """Remove the Hugging Face directories older than `current` whose checkpoint rotation
    deleted (each renamed aside first, so none is ever half-deleted under its name)."""
    import shutil
    import uuid

    from pipeline.checkpoint.layout import parse_iteration_dir_name

    for entry in (save_dir / "hf").iterdir():
        iteration = parse_iteration_dir_name(entry.name)
        if iteration is None or iteration >= current or (save_dir / entry.name).is_dir():
            continue
        trash = entry.with_name(f".{entry.name}.trash-{uuid.uuid4().hex[:12]}")
        entry.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def tokenizer_mismatch(data: dict[str, Any] | None, model: dict[str, Any] | None) -> str | None:
    """Why the data's tokenizer record and the Hugging Face model's differ (a vocabulary file of
    the same name with other bytes; a chat template changes no token), or None when they agree
    or either is unknown."""

    def hashes(record: dict[str, Any] | None) -> dict[str, str]:
        files = ((record or {}).get("fingerprint") or {}).get("files") or []
        named = {Path(f["path"]).name: f.get("sha256") for f in files}
        return {name: h for name, h in named.items() if name in _VOCABULARY_FILES}

    ours, theirs = hashes(data), hashes(model)
    differing = sorted(n for n in ours.keys() & theirs.keys() if ours[n] != theirs[n])
    if not differing:
        return None
    return f"the data was tokenized with another {differing[0]} than the model's"


class TrainedModelSource:
    """The training model's weights as a `TensorSource` of full fp32 CPU tensors (see the module
    docstring: reads are collectives). Built by every rank at the same point."""

    def __init__(
        self,
        parts: list[Transformer],
        config: ModelConfig,
        layout: ParallelDims,
        metadata: dict[str, Any],
    ) -> None:
        self.model_config = config
        self.metadata = metadata
        with torch.device("meta"):
            state = Transformer(config).state_dict()
        self._infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in state.items()}
        self._local = _local_tensors(parts)
        self.reads = 0
        """Tensors read so far (a writer that fails makes the rest of the reads)."""
        self._group = layout.pipeline_group
        self._owner: dict[str, int] = {}
        if self._group is not None:
            held = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(held, sorted(self._local), group=self._group)
            for group_rank, names in enumerate(held):
                self._owner.update(dict.fromkeys(names, group_rank))
        # Only the pipeline group of the writing rank (global rank 0) moves tensors between stages.
        self._to_writer = self._group is not None and 0 in dist.get_process_group_ranks(self._group)

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        self.reads += 1
        info = self._infos[name]
        local = self._local.get(name)
        full = None
        if local is not None:
            full = local.full_tensor() if isinstance(local, DTensor) else local
            full = full.detach()
        if self._to_writer:
            full = self._broadcast(name, full, info)
        if full is None:  # a stage that neither holds nor receives it: the read was the point
            return torch.empty(info.shape, dtype=info.dtype, device="meta")
        return full.to(device="cpu", dtype=info.dtype, copy=True)

    def _broadcast(self, name: str, full: torch.Tensor | None, info: TensorInfo) -> torch.Tensor:
        """`name` from the pipeline stage that holds it to the others of the writer's group."""
        on_gpu = dist.get_backend(self._group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
        if full is None:
            full = torch.empty(info.shape, dtype=info.dtype, device=device)
        else:
            full = full.to(device=device, dtype=info.dtype).contiguous()
        dist.broadcast(full, group=self._group, group_src=self._owner[name])
        return full


def write_hf_from_model(
    parts: list[Transformer],
    config: ModelConfig,
    layout: ParallelDims,
    metadata: dict[str, Any],
    output: str | os.PathLike,
    dtype_name: str = "auto",
) -> Path:
    """Write the model as a Hugging Face directory `output` (replacing one left there by an
    earlier attempt at the same iteration); every rank calls this, the first writes. Tokenizer
    files come from the tokenizer `metadata` records, when its files are still there.

    A failure of the writer is every rank's: the writer still makes the reads the others wait
    on, then all of them raise `CheckpointError` together (nothing is left under `output`)."""
    from pipeline.checkpoint.layout import CheckpointError
    from pipeline.weights.dtype_choice import choose_dtype
    from pipeline.weights.hf_writer import read_in_write_order, recorded_tokenizer_dir, write_hf
    from pipeline.weights.source import CastSource

    source = TrainedModelSource(parts, config, layout, metadata)
    requested = None if dtype_name == "auto" else dtype_name
    cast = CastSource(source, choose_dtype(requested, source).dtype, keep=(".moe.expert_bias",))
    error = None
    if layout.rank != 0:
        read_in_write_order(cast)
    else:
        try:
            tokenizer_dir = recorded_tokenizer_dir(metadata.get("tokenizer"))
            write_hf(cast, output, tokenizer_dir=tokenizer_dir, overwrite=True)
        except (OSError, ValueError) as e:
            error = " ".join(str(e).split())
            read_in_write_order(cast, skip=source.reads)
    if _any_rank(error is not None, layout):
        raise CheckpointError(f"saving the Hugging Face model {output}: {error or 'rank 0 failed'}")
    return Path(output)


def _any_rank(flag: bool, layout: ParallelDims) -> bool:
    """Whether `flag` is true on any rank (one all-reduce; just `flag` for one process)."""
    group = layout.world_group
    if group is None:
        return flag
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
