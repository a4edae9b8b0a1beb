"""Write a `TensorSource` as a Hugging Face model directory, streaming one tensor at a time.

Shards are planned from `source.tensors()` (shapes and dtypes are known before anything is
read), so each safetensors header is written first and the tensors follow as they are read and
converted: peak memory is about the largest source tensor, whatever the model size. The whole
directory is built beside the output and renamed into place at the end, so a crash never leaves
a half-written model under the final name.

BLOOM and MPT store q, k and v as one fused projection: the source is read through
`with_fused_qkv` (`pipeline.weights.fused_qkv`), which lists and reads them fused.

Tied embeddings: when `model_config.tie_word_embeddings`, only `tok_embeddings.weight` is
written (as `model.embed_tokens.weight`; no `lm_head.weight` on disk, as transformers expects);
an `output.weight` the source may list anyway is skipped.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.common.atomic import staged_directory, write_json
from pipeline.common.safetensors_io import (
    SAFETENSORS_DTYPES,
    require_little_endian,
    tensor_bytes,
    write_safetensors_header,
)
from pipeline.core.model.hf_names import (
    MTP_SHARED_COPIES,
    as_layer_name,
    is_reordered,
    linear_attention_layers,
    pipe_to_hf_names,
    reorder_to_hf,
)
from pipeline.weights.fused_experts import HF_NAMED, fused_view
from pipeline.weights.fused_qkv import with_fused_qkv
from pipeline.weights.hf_config import choose_architecture, config_to_hf, generation_config
from pipeline.weights.source import TensorInfo, TensorSource

__all__ = [
    "TOKENIZER_FILES",
    "HFPiece",
    "HFShard",
    "plan_hf_shards",
    "read_in_write_order",
    "recorded_tokenizer_dir",
    "write_hf",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers 4.x's "5GB"


@dataclass(frozen=True)
class HFPiece:
    """One on-disk tensor: `source_name` (or expert `index` of that stacked tensor) cast to
    `dtype`, or `make` of it when set (a quantizer's; with no `source_name`, `make(None)`)."""

    hf_name: str
    source_name: str | None
    index: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[torch.Tensor | None], torch.Tensor] | None = None

    def build(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """This piece's on-disk tensor from its group's source tensor."""
        part = tensor if self.index is None or tensor is None else tensor[self.index]
        return self.make(part) if self.make is not None else part.to(self.dtype)

    @property
    def nbytes(self) -> int:
        return TensorInfo(self.shape, self.dtype).nbytes


@dataclass
class HFShard:
    """One safetensors file: its pieces grouped by source tensor, in writing order."""

    groups: list[list[HFPiece]]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for g in self.groups for p in g)

    @property
    def pieces(self) -> list[HFPiece]:
        return [p for g in self.groups for p in g]


def _out_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def as_written(source: TensorSource) -> TensorSource:
    """`source` as the files of its architecture lay it out: BLOOM's and MPT's fused q/k/v,
    gpt-oss's and Mistral 4's fused experts (`pipeline.weights.fused_experts`). Applying it
    twice changes nothing."""
    architecture = choose_architecture(source.model_config, source.metadata.get("hf_architecture"))
    return fused_view(with_fused_qkv(source, architecture), architecture)


def _groups(source: TensorSource, dtype: torch.dtype | None) -> list[list[HFPiece]]:
    """The on-disk pieces of each source tensor (expert stacks give one piece per expert)."""
    cfg = source.model_config
    infos = source.tensors()
    if not cfg.tie_word_embeddings and "output.weight" not in infos:
        raise ValueError("source has no output.weight and tie_word_embeddings is false")
    num_experts = cfg.moe.num_experts if cfg.moe is not None else None
    architecture = choose_architecture(cfg, source.metadata.get("hf_architecture"))
    linear = linear_attention_layers(cfg)
    groups = []
    for name, info in infos.items():
        if name == "output.weight" and cfg.tie_word_embeddings:
            continue
        # DeepSeek's correction bias stays fp32, as transformers keeps it (a bf16 step of 1e-3
        # would vanish next to biases of order 1).
        out = info.dtype if name.endswith(".moe.expert_bias") else _out_dtype(info, dtype)
        if out not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {out} has no safetensors encoding")
        if name.startswith(HF_NAMED):
            hf_names = [name.removeprefix(HF_NAMED)]
        else:
            hf_names = pipe_to_hf_names(as_layer_name(name), num_experts, architecture, linear)
        if len(hf_names) == 1:
            make = None
            if is_reordered(name, cfg):  # linear attention's channels, back in HF's order

                def make(t: torch.Tensor, name: str = name, out: torch.dtype = out) -> torch.Tensor:
                    return reorder_to_hf(name, t, cfg).to(out)

            groups.append([HFPiece(hf_names[0], name, None, info.shape, out, make)])
        elif info.shape[0] != len(hf_names):
            raise ValueError(f"{name}: shape {info.shape} does not hold {len(hf_names)} experts")
        else:
            experts = enumerate(hf_names)
            groups.append([HFPiece(n, name, e, info.shape[1:], out) for e, n in experts])
    return groups + _mtp_shared_copies(source, dtype)


def _mtp_shared_copies(source: TensorSource, dtype: torch.dtype | None) -> list[list[HFPiece]]:
    """DeepSeek stores, in each multi-token prediction layer, copies of the shared embedding
    and output layer (`embed_tokens`, `shared_head.head`); vLLM's and SGLang's MTP loaders
    read them there."""
    cfg, infos = source.model_config, source.tensors()
    groups = []
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers):
        for suffix, shared in MTP_SHARED_COPIES.items():
            if shared == "output.weight" and cfg.tie_word_embeddings:
                shared = "tok_embeddings.weight"
            info = infos[shared]
            piece = HFPiece(
                f"model.layers.{i}.{suffix}", shared, None, info.shape, _out_dtype(info, dtype)
            )
            groups.append([piece])
    return groups


GroupRewrite = Callable[[list[list[HFPiece]]], list[list[HFPiece]]]


def plan_hf_shards(
    source: TensorSource,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    rewrite: GroupRewrite | None = None,
) -> list[HFShard]:
    """Split the source's tensors into shards of at most `max_shard_bytes` (a single tensor
    larger than that gets a shard of its own, as transformers does). The pieces of one source
    tensor (an expert stack) stay in one shard so each source tensor is read exactly once.
    `rewrite` (a quantizer) may replace pieces and add groups before the split."""
    shards: list[HFShard] = []
    current: list[list[HFPiece]] = []
    size = 0
    groups = _groups(as_written(source), dtype)
    for group in rewrite(groups) if rewrite is not None else groups:
        group_bytes = sum(p.nbytes for p in group)
        if current and size + group_bytes > max_shard_bytes:
            shards.append(HFShard(current))
            current, size = [], 0
        current.append(group)
        size += group_bytes
    if current:
        shards.append(HFShard(current))
    for shard in shards:
        # Larger items first keeps every tensor's data aligned to its element size.
        shard.groups.sort(key=lambda g: -g[0].dtype.itemsize)
    return shards


def _write_shard(
    path: Path, shard: HFShard, source: TensorSource, step: Callable[[int], None]
) -> None:
    with open(path, "wb") as f:
        entries = [(p.hf_name, p.dtype, p.shape) for p in shard.pieces]
        write_safetensors_header(f, entries)
        for group in shard.groups:
            first = group[0]
            tensor = None if first.source_name is None else source.read(first.source_name)
            for piece in group:
                part = piece.build(tensor)
                if (tuple(part.shape), part.dtype) != (piece.shape, piece.dtype):
                    raise ValueError(
                        f"{piece.hf_name}: built {tuple(part.shape)} {part.dtype}, "
                        f"planned {piece.shape} {piece.dtype}"
                    )
                f.write(tensor_bytes(part))
                step(piece.nbytes)
            del tensor


def _token_ids(source: TensorSource) -> tuple[int | None, int | list[int] | None]:
    """bos/eos ids from the source's metadata: an HF source's, else the end-of-document id of
    the tokenizer a training run recorded (`eod_id`; `eod` in a preprocess manifest's record)."""
    meta = source.metadata
    eos = meta.get("eos_token_id")
    if eos is None:
        tokenizer = meta.get("tokenizer") or {}
        eos = tokenizer.get("eod_id", tokenizer.get("eod"))
    return meta.get("bos_token_id"), eos


def _generation_eos(source: TensorSource, eos: int | list[int] | None) -> int | list[int] | None:
    """generation_config.json's end ids: the config's, then the end-of-turn ids a Hugging Face
    source's own generation_config.json named (an instruct model's `<|eot_id|>`), so generation
    from the written directory stops where it stopped from the source."""
    extra = source.metadata.get("generation_eos_token_id") or []
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    ids += [i for i in extra if i not in ids]
    if not extra:
        return eos
    return ids[0] if len(ids) == 1 else ids


def read_in_write_order(
    source: TensorSource,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    skip: int = 0,
) -> None:
    """Read every tensor `write_hf` would read for the same arguments, in its order (after the
    first `skip`), writing nothing: what the other ranks of a run do while the first writes a
    source whose reads are collectives (gathering a sharded model), and what a writer that
    failed does to finish its part of them."""
    source = as_written(source)
    shards = plan_hf_shards(source, dtype=dtype, max_shard_bytes=max_shard_bytes)
    names = [g[0].source_name for s in shards for g in s.groups if g[0].source_name is not None]
    for name in names[skip:]:
        source.read(name)  # the read is the point; the tensor is dropped at once


def recorded_tokenizer_dir(tokenizer: dict[str, Any] | None) -> Path | None:
    """The directory of the tokenizer a checkpoint recorded, if its files are still there and
    unchanged (same SHA-256); None otherwise (mock data, moved or edited files)."""
    from pipeline.common.hashing import sha256_file

    files = ((tokenizer or {}).get("fingerprint") or {}).get("files") or []
    if not files:
        return None
    for record in files:
        path = Path(record["path"])
        if not path.is_file() or sha256_file(path) != record.get("sha256"):
            warnings.warn(
                f"the recorded tokenizer file {path} is missing or changed; "
                "no tokenizer files copied (pass --tokenizer DIR)",
                stacklevel=2,
            )
            return None
    return Path(files[0]["path"]).parent


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    tokenizer_dir = tokenizer_dir.parent if tokenizer_dir.is_file() else tokenizer_dir
    copied = 0
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
            copied += 1
    if not copied:
        raise FileNotFoundError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_dir}"
        )


def _write_weights(tmp: Path, shards: list, source: TensorSource, step: Callable) -> None:
    """The safetensors files of `shards` in `tmp` and, for more than one, their index."""
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        )
        _write_shard(tmp / name, shard, source, step)
        weight_map |= {p.hf_name: name for p in shard.pieces}
        total += shard.nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(tmp / "model.safetensors.index.json", index)


def _write_configs(
    tmp: Path, shards: list, source: TensorSource, config_extra: dict[str, Any] | None
) -> None:
    """config.json (with `config_extra`) and generation_config.json for `source`."""
    pieces = [p for s in shards for p in s.pieces]
    # config.json's dtype is the embedding's (what from_pretrained allocates by default)
    embed = next((p for p in pieces if p.source_name == "tok_embeddings.weight"), pieces[0])
    bos, eos = _token_ids(source)
    config = config_to_hf(
        source.model_config,
        dtype=embed.dtype,
        architecture=source.metadata.get("hf_architecture"),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=source.metadata.get("pad_token_id"),
    )
    write_json(tmp / "config.json", config | (config_extra or {}))
    write_json(tmp / "generation_config.json", generation_config(bos, _generation_eos(source, eos)))


def write_hf(
    source: TensorSource,
    output_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
    rewrite: GroupRewrite | None = None,
    config_extra: dict[str, Any] | None = None,
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Write `source` as a Hugging Face model directory loadable by `from_pretrained`.

    `dtype` casts floating-point tensors (None keeps each tensor's own dtype). `progress` is
    called after each tensor with the cumulative bytes of tensor data written; the total is
    `sum(s.nbytes for s in plan_hf_shards(...))`. Tokenizer files found in `tokenizer_dir` are
    copied. An existing non-empty `output_dir` is refused unless `overwrite`. Returns the path.
    A quantizing export passes `rewrite` (see `plan_hf_shards`), keys to add to config.json
    (`config_extra`) and more JSON files (`extra_json`, file name -> object).
    """
    source = as_written(source)
    shards = plan_hf_shards(source, dtype=dtype, max_shard_bytes=max_shard_bytes, rewrite=rewrite)
    done = 0

    def step(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done)

    require_little_endian()
    with staged_directory(output_dir, overwrite=overwrite) as tmp:
        _write_weights(tmp, shards, source, step)
        _write_configs(tmp, shards, source, config_extra)
        for name, obj in (extra_json or {}).items():
            write_json(tmp / name, obj)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
    return Path(output_dir)
