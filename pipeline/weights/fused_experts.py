"""Expert stacks written fused, as transformers >= 5 holds them, for the architectures that have
no per-expert spelling on disk (Mistral 4: `hf_names.FUSED_EXPERTS`).

`FusedExperts` shows a source with each MoE layer's w1 and w3 replaced by one virtual tensor
`layers.{i}.moe.experts.w13` `[E, 2 * ffn, hidden]` (per expert, w1's rows then w3's), read
as w1 then w3 of the wrapped source. Every rank of a gathered source makes the same reads in the
same order through it, so the Hugging Face writer's plan stays the same on all ranks.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pipeline.core.model.hf_names import FUSED_EXPERTS, FUSED_GATE_UP
from pipeline.weights.source import TensorInfo, TensorSource

__all__ = ["FusedExperts", "fused_view"]

_W1 = re.compile(r"(.*\.moe\.experts\.)w1")


class FusedExperts:
    """`source` with w1 / w3 of each expert stack joined as `w13` (see the module docstring)."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.model_config = source.model_config
        self.metadata: dict[str, Any] = source.metadata
        self._infos: dict[str, TensorInfo] = {}
        self._joined: dict[str, tuple[str, str]] = {}
        for name, info in source.tensors().items():
            m = _W1.fullmatch(name)
            if m is not None:
                fused = m.group(1) + FUSED_GATE_UP
                self._joined[fused] = (name, m.group(1) + "w3")
                shape = (info.shape[0], 2 * info.shape[1], *info.shape[2:])
                self._infos[fused] = TensorInfo(shape, info.dtype)
            elif not name.endswith(".moe.experts.w3"):
                self._infos[name] = info

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        if name not in self._joined:
            return self.source.read(name)
        w1, w3 = self._joined[name]
        return torch.cat((self.source.read(w1), self.source.read(w3)), dim=1)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def fused_view(source: TensorSource, architecture: str) -> TensorSource:
    """`source` as `FusedExperts` when `architecture` stores its experts fused, else itself."""
    if architecture in FUSED_EXPERTS and not isinstance(source, FusedExperts):
        return FusedExperts(source)
    return source
