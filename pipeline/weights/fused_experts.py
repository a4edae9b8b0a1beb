"""A source's expert tensors as the weight files of its architecture hold them fused
(`pipeline.core.model.hf_fused_experts`): gpt-oss's interleaved gate/up, input-major
projections and router, and Mistral 4's gate_up halves (`FUSED_EXPERTS`).

`FusedExperts` lists, in place of the first of our tensors each fused one is made of, one
virtual tensor read as theirs from ours: gpt-oss's under `hf:<their name>` (`HF_NAMED`), which
the Hugging Face writer takes as its name; Mistral 4's gate_up as our
`layers.{i}.moe.experts.w13` `[E, 2 * ffn, hidden]`, which `hf_names.pipe_to_hf_names` names
and the FP8 exports quantize as one of ours. Every rank of a gathered source makes the same
reads in the same order through it, so the writer's plan stays the same on all ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.core.model.hf_fused_experts import (
    FUSED_EXPERTS,
    FUSED_GATE_UP,
    GPT_OSS,
    INTERLEAVED,
    fuse,
    fused_parts,
    layout_of,
)
from pipeline.weights.source import TensorInfo, TensorSource

__all__ = ["HF_NAMED", "FusedExperts", "fused_view"]

HF_NAMED = "hf:"  # the name prefix of a tensor listed by its Hugging Face name


class FusedExperts:
    """`source` with the expert tensors of `layout` fused (see the module docstring)."""

    def __init__(self, source: TensorSource, layout: str) -> None:
        self.source = source
        self.layout = layout
        self.model_config = source.model_config
        self.metadata: dict[str, Any] = source.metadata
        self._infos: dict[str, TensorInfo] = {}
        self._fused: dict[str, tuple[str, list[str]]] = {}  # listed name -> (theirs, ours)
        infos = source.tensors()
        for name, info in infos.items():
            fused = fused_parts(name, layout)
            if fused is None:
                self._infos[name] = info
                continue
            hf_name, parts = fused
            key = HF_NAMED + hf_name if layout == INTERLEAVED else _our_gate_up(parts)
            if key in self._infos:
                continue
            missing = [p for p in parts if p not in infos]
            if missing:
                raise ValueError(f"{hf_name} needs {', '.join(missing)}, which the source lacks")
            metas = [torch.empty(infos[p].shape, dtype=info.dtype, device="meta") for p in parts]
            self._fused[key] = (hf_name, parts)
            self._infos[key] = TensorInfo(tuple(fuse(hf_name, metas, layout).shape), info.dtype)

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        if name not in self._fused:
            return self.source.read(name)
        hf_name, parts = self._fused[name]
        return fuse(hf_name, [self.source.read(part) for part in parts], self.layout)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def _our_gate_up(parts: list[str]) -> str:
    """`...moe.experts.w13` for its parts `...moe.experts.w1`, `...w3`."""
    return parts[0].removesuffix("w1") + FUSED_GATE_UP


def fused_view(source: TensorSource, architecture: str) -> TensorSource:
    """`source` as `FusedExperts` when `architecture` stores its experts fused, else itself."""
    if isinstance(source, FusedExperts) or not (
        architecture == GPT_OSS or architecture in FUSED_EXPERTS
    ):
        return source
    return FusedExperts(source, layout_of(architecture))
