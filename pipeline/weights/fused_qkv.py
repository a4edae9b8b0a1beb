"""BLOOM's and MPT's fused q/k/v projection <-> our separate `wq`, `wk`, `wv`.

Their weight files hold one `[3 * hidden, hidden]` projection a layer (and BLOOM one bias),
which our names call `layers.{i}.attention.wqkv.{weight,bias}`. The rows come in one of two
orders:

- "per_head" (BLOOM): head by head, each head's q, then k, then v rows, so the fused output
  viewed as `[heads, 3, head_dim]` gives the three;
- "stacked" (MPT): all q rows, then all k rows, then all v rows.

Splitting and fusing only move rows, so a round trip is bit-exact. Our model keeps the three
projections apart, so tensor parallelism, LoRA and every exporter see one layout; the fused
tensor exists only in the files (`split_fused_qkv` when reading, `FusedQKVSource` when writing).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from pipeline.weights.source import TensorInfo

if TYPE_CHECKING:
    from pipeline.core.model.config import ModelConfig
    from pipeline.weights.source import TensorSource

__all__ = ["FUSED_QKV_LAYOUTS", "FusedQKVSource", "fuse_qkv", "split_qkv", "with_fused_qkv"]

FUSED_QKV_LAYOUTS: dict[str, str] = {"BloomForCausalLM": "per_head", "MptForCausalLM": "stacked"}
FUSED = re.compile(r"(layers\.\d+\.attention\.)wqkv\.(weight|bias)")
_PARTS = ("wq", "wk", "wv")


def split_qkv(fused: torch.Tensor, layout: str, heads: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v) rows of a fused projection's weight `[3 * heads * head_dim, in]` or bias."""
    if layout == "stacked":
        return tuple(t.clone() for t in fused.chunk(3, dim=0))
    rest = fused.shape[1:]
    per_head = fused.view(heads, 3, -1, *rest)
    return tuple(per_head[:, part].reshape(-1, *rest).clone() for part in range(3))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, heads: int):
    """The fused projection of `split_qkv`'s three parts, in `layout`'s row order."""
    if layout == "stacked":
        return torch.cat((q, k, v), dim=0)
    rest = q.shape[1:]
    parts = [t.view(heads, -1, *rest) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *rest)


def split_names(fused_name: str) -> list[str] | None:
    """Our `wq`, `wk`, `wv` names for a fused name (`layers.{i}.attention.wqkv.{p}`), else None."""
    m = FUSED.fullmatch(fused_name)
    return None if m is None else [f"{m.group(1)}{part}.{m.group(2)}" for part in _PARTS]


def split_infos(infos: dict[str, TensorInfo]) -> dict[str, tuple[str, int, TensorInfo]]:
    """For each fused tensor of `infos`, its three parts: our name -> (the fused name, the
    part's index, its shape and dtype)."""
    out = {}
    for name, info in infos.items():
        parts = split_names(name)
        if parts is None:
            continue
        if info.shape[0] % 3:
            raise ValueError(f"{name}: {info.shape[0]} rows do not split into q, k and v")
        shape = (info.shape[0] // 3, *info.shape[1:])
        for index, part in enumerate(parts):
            out[part] = (name, index, TensorInfo(shape, info.dtype))
    return out


class FusedQKVSource:
    """`source` with each layer's `wq`, `wk`, `wv` listed and read as one fused
    `layers.{i}.attention.wqkv` tensor in `layout`'s order (for writing BLOOM or MPT files)."""

    def __init__(self, source: TensorSource, layout: str) -> None:
        self.source, self.layout = source, layout

    @property
    def model_config(self) -> ModelConfig:
        return self.source.model_config

    @property
    def metadata(self) -> dict[str, Any]:
        return self.source.metadata

    def tensors(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for name, info in self.source.tensors().items():
            m = re.fullmatch(r"(layers\.\d+\.attention\.)w[qkv]\.(weight|bias)", name)
            if m is None:
                out[name] = info
            elif name.split(".")[3] == "wq":
                out[f"{m.group(1)}wqkv.{m.group(2)}"] = TensorInfo(
                    (3 * info.shape[0], *info.shape[1:]), info.dtype
                )
        return out

    def read(self, name: str) -> torch.Tensor:
        parts = split_names(name)
        if parts is None:
            return self.source.read(name)
        heads = self.model_config.num_attention_heads
        return fuse_qkv(*(self.source.read(part) for part in parts), self.layout, heads)


def with_fused_qkv(source: TensorSource, architecture: str) -> TensorSource:
    """`source` as the files of `architecture` hold it: fused q/k/v for BLOOM and MPT
    (`FusedQKVSource`), else unchanged."""
    layout = FUSED_QKV_LAYOUTS.get(architecture)
    if layout is None or isinstance(source, FusedQKVSource):
        return source
    return FusedQKVSource(source, layout)
