"""What every converter reads from and writes to: a stream of named full tensors.

A `TensorSource` describes a model's weights under *our* parameter names (those of the
single-device `Transformer`, e.g. `layers.3.attention.wq.weight`, `layers.0.moe.experts.w1`)
without holding them: shapes and dtypes come from file metadata, and `read` materialises one
full tensor at a time. Readers (our DCP checkpoints, Hugging Face safetensors, Megatron
torch_dist) produce sources; writers (our DCP checkpoints, Hugging Face safetensors) consume
them tensor by tensor, so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from pipeline.core.model.config import ModelConfig

__all__ = ["CastSource", "InMemorySource", "TensorInfo", "TensorSource"]


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one full tensor, known before it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


class TensorSource(Protocol):
    """A model's weights, readable one tensor at a time (see the module docstring)."""

    model_config: ModelConfig
    """The architecture, as our `ModelConfig` (true vocabulary size, no padding)."""
    metadata: dict[str, Any]
    """Free-form provenance: `tokenizer` (the run's tokenizer metadata, with the directory or
    file it was loaded from, when known), `iteration`, `source` (what was read)."""

    def tensors(self) -> dict[str, TensorInfo]:
        """Our parameter name -> shape and dtype, in a stable order (layers in order)."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """The full tensor `name` (a fresh CPU tensor the caller may keep or modify)."""
        ...


@dataclass
class InMemorySource:
    """A `TensorSource` over tensors already in memory (tests, small models)."""

    model_config: ModelConfig
    state: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self.state.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.state[name].detach().clone()


@dataclass
class CastSource:
    """`source` with every floating-point tensor converted to `dtype` as it is read, except
    those whose names end with one of `keep` (e.g. a router an export keeps in fp32)."""

    source: TensorSource
    dtype: torch.dtype
    keep: tuple[str, ...] = ()

    @property
    def model_config(self) -> ModelConfig:
        return self.source.model_config

    @property
    def metadata(self) -> dict[str, Any]:
        """The source's, with the Hugging Face dtype (if recorded) now the cast one."""
        metadata = self.source.metadata
        if metadata.get("hf_dtype") is None:
            return metadata
        return {**metadata, "hf_dtype": str(self.dtype).removeprefix("torch.")}

    def _casts(self, name: str, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point and not name.endswith(self.keep)

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(info.shape, self.dtype) if self._casts(name, info.dtype) else info
            for name, info in self.source.tensors().items()
        }

    def read(self, name: str) -> torch.Tensor:
        tensor = self.source.read(name)
        return tensor.to(self.dtype) if self._casts(name, tensor.dtype) else tensor
