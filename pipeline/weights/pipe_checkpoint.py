"""Our own checkpoints as a `TensorSource`, and a streaming writer of new ones.

`PipeCheckpointSource` reads the model weights of a `pipe train` checkpoint (a DCP directory
with `pipe_metadata.json`) one full tensor at a time: DCP assembles a tensor from whatever
shards the saving layout wrote, so any layout reads the same. Tied embeddings are presented
once, as `tok_embeddings.weight`.

`write_pipe_checkpoint` writes a weights-only checkpoint that `pipe train --load DIR --finetune`
(or any layout's resume of the weights) reads, through the checkpoint module's atomic commit.
DCP's own save wants every tensor in memory; here a planner describes the tensors from their
shapes alone and reads each one from the source only when DCP writes it, so memory stays near
one tensor. With a `TargetLayout` each tensor is cut into the chunks that layout's ranks hold
(tensor-parallel splits, expert-parallel splits), so a run started under that layout reads
exactly its own pieces (offline re-layout); the tensors themselves are unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.weights.source import TensorInfo, TensorSource

if TYPE_CHECKING:
    import torch


__all__ = [
    "PipeCheckpointSource",
    "TargetLayout",
    "hf_record",
    "tensor_chunks",
    "write_pipe_checkpoint",
]

MODEL_PREFIX = "model."
# Recorded so a Hugging Face export writes them back (architecture, dtype, bos/eos ids) and
# generation stops where the source's generation_config.json said.
_HF_KEYS = (
    "hf_architecture",
    "hf_dtype",
    "bos_token_id",
    "eos_token_id",
    "generation_eos_token_id",
)


class PipeCheckpointSource:
    """The model weights of a `pipe` checkpoint (a save directory or one `iter_*` directory).

    Every file read is checked against the SHA-256 in `pipe_metadata.json` as it is read,
    unless `verify_checksums` is False: a file is complete once its last model tensor has been
    read, so a damaged one fails (naming it) before a writer commits its output.
    """

    def __init__(
        self, path: str | Path, iteration: int | None = None, *, verify_checksums: bool = True
    ) -> None:
        from pipeline.checkpoint.layout import DCP_METADATA, CheckpointError, read_pipe_metadata
        from pipeline.checkpoint.loader import resolve_checkpoint_dir, verified_files
        from pipeline.core.model.config import model_config_from_dict

        self.directory = resolve_checkpoint_dir(path, iteration)
        record = read_pipe_metadata(self.directory) or {}
        meta = record.get("metadata") or {}
        if "model" not in meta:
            raise CheckpointError(f"{self.directory}: no model config in {DCP_METADATA} metadata")
        self.model_config = model_config_from_dict(meta["model"])
        self.metadata = {
            "source": str(self.directory),
            "iteration": record.get("iteration"),
            "tokenizer": meta.get("tokenizer"),
            "layout": meta.get("layout"),
            **(meta.get("hf") or {}),
        }
        # Parsed once; every read hands it to DCP instead of reading the file again.
        self._files, self._dcp_metadata = verified_files(self.directory, record, verify_checksums)
        self._infos = self._read_infos(self._dcp_metadata)
        self._files.want(self._model_ranges())

    def _read_infos(self, dcp_metadata: Any) -> dict[str, TensorInfo]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        infos = {}
        for fqn, item in dcp_metadata.state_dict_metadata.items():
            if fqn.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
                info = TensorInfo(tuple(item.size), item.properties.dtype)
                infos[fqn[len(MODEL_PREFIX) :]] = info
        if self.model_config.tie_word_embeddings:
            infos.pop("output.weight", None)
        return dict(sorted(infos.items(), key=lambda kv: _name_order(kv[0])))

    def _model_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Per data file, the byte ranges of the model tensors this source offers."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for index, info in self._dcp_metadata.storage_data.items():
            name = index.fqn[len(MODEL_PREFIX) :]
            if index.fqn.startswith(MODEL_PREFIX) and name in self._infos:
                ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        return ranges

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        return self.read_many([name])[name]

    def read_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Several full tensors in one DCP read."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from pipeline.checkpoint.safe_reader import dcp_error, safe_file_system_reader

        out = {n: torch.empty(self._infos[n].shape, dtype=self._infos[n].dtype) for n in names}
        reader = safe_file_system_reader(self.directory, self._dcp_metadata, self._files)
        try:
            dcp.load({"model": out}, storage_reader=reader, no_dist=True)
        except CheckpointException as error:
            raise dcp_error(error, f"{self.directory}: reading {', '.join(names)}") from None
        return out


def _name_order(name: str) -> tuple:
    """Embedding first, layers in numeric order, then the final norm and output."""
    match = re.match(r"layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if name.startswith("tok_embeddings") else 2, 0, name)


# ---- writing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetLayout:
    """The layout a written checkpoint is cut for: tensor-, pipeline- and expert-parallel
    degrees (data parallelism shards again at load time and is not fixed here)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1


# Which dimension tensor parallelism splits, by the end of a parameter name (see
# `pipeline.core.parallel.tensor_parallel`): column-parallel on the output rows, row-parallel on
# the input columns, the vocabulary on rows; norms, the router and experts stay whole.
_TP_DIM = [
    (re.compile(r"attention\.w[qkv]\.(weight|bias)$"), 0),
    (re.compile(r"feed_forward\.w[13]\.weight$"), 0),
    (re.compile(r"attention\.wo\.weight$"), 1),
    (re.compile(r"feed_forward\.w2\.weight$"), 1),
    (re.compile(r"^(tok_embeddings|output)\.weight$"), 0),
]
_EXPERT = re.compile(r"moe\.experts\.w[123]$")


def tensor_chunks(
    name: str, shape: tuple[int, ...], layout: TargetLayout
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the pieces `layout`'s ranks hold of tensor `name`: split over tp on
    its tensor-parallel dimension, experts over ep on dim 0 (torch.chunk sizes, as DTensor's
    Shard uses), else whole."""
    dim, parts = None, 1
    if layout.ep > 1 and _EXPERT.search(name):
        dim, parts = 0, layout.ep
    elif layout.tp > 1:
        dim = next((d for pattern, d in _TP_DIM if pattern.search(name)), None)
        parts = layout.tp if dim is not None else 1
    if dim is None or parts == 1:
        return [((0,) * len(shape), tuple(shape))]
    step = -(-shape[dim] // parts)
    chunks = []
    for start in range(0, shape[dim], step):
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(min(step, shape[d] - start) if d == dim else s for d, s in enumerate(shape))
        chunks.append((offsets, sizes))
    return chunks


def hf_record(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a pipe checkpoint records (as `metadata["hf"]`) of the Hugging Face model its
    weights came from: architecture, dtype, bos/eos and generation end ids; a
    `PipeCheckpointSource` hands them back in its metadata."""
    return {k: metadata[k] for k in _HF_KEYS if metadata.get(k) is not None}


def write_pipe_checkpoint(
    source: TensorSource,
    output: str | Path,
    *,
    layout: TargetLayout | None = None,
    iteration: int = 0,
    progress: Any = None,
) -> Path:
    """Write `source`'s weights as a committed `pipe` checkpoint `output/iter_XXXXXXX` (with the
    `latest` tracker), cut for `layout`; returns the iteration directory. `progress` is called
    with the bytes of each tensor written."""
    from pipeline.checkpoint import save

    layout = layout or TargetLayout()
    config = source.model_config
    if layout.pp > config.num_layers:
        raise ValueError(f"pp {layout.pp} exceeds the model's {config.num_layers} layers")
    planner = _streaming_planner(_TiedOutput(source), layout, progress)
    metadata = {
        "iteration": iteration,
        "model": dataclasses.asdict(config),
        "tokenizer": source.metadata.get("tokenizer"),
        "layout": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": 1, "dp": 1},
        "converted_from": source.metadata.get("source"),
        "hf": hf_record(source.metadata),
    }
    return Path(save(output, iteration, {}, metadata, save_rng=False, planner=planner))


class _TiedOutput:
    """`source` plus `output.weight` read from the embedding when the model ties them: the
    model's state dict (what training loads) names the shared tensor twice."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.model_config = source.model_config
        self.metadata = source.metadata
        self._infos = source.tensors()
        if self.model_config.tie_word_embeddings and "output.weight" not in self._infos:
            self._infos["output.weight"] = self._infos["tok_embeddings.weight"]

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        tied = name == "output.weight" and self.model_config.tie_word_embeddings
        return self.source.read("tok_embeddings.weight" if tied else name)


def _streaming_planner(source: TensorSource, layout: TargetLayout, progress: Any) -> Any:
    """A DCP save planner whose plan comes from `source.tensors()` and whose data is read from
    the source as each item is written (one full tensor cached for its other chunks)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    infos = source.tensors()

    class StreamingSavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self._cached: tuple[str, torch.Tensor] | None = None

        def create_local_plan(self) -> SavePlan:
            items = []
            for name, info in infos.items():
                chunks = tensor_chunks(name, info.shape, layout)
                kind = WriteItemType.TENSOR if len(chunks) == 1 else WriteItemType.SHARD
                for offsets, sizes in chunks:
                    items.append(
                        WriteItem(
                            index=MetadataIndex(MODEL_PREFIX + name, torch.Size(offsets)),
                            type=kind,
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                properties=TensorProperties(dtype=info.dtype),
                                size=torch.Size(info.shape),
                            ),
                        )
                    )
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            name = write_item.index.fqn[len(MODEL_PREFIX) :]
            if self._cached is None or self._cached[0] != name:
                self._cached = (name, source.read(name).contiguous())
            full = self._cached[1]
            chunk = write_item.tensor_data.chunk
            piece = full
            for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                piece = piece.narrow(dim, start, size)
            if progress is not None:
                progress(piece.numel() * piece.element_size())
            return piece.contiguous()

    return StreamingSavePlanner()
