"""`StageUnion`: the pipeline stages one rank holds, seen as one model with the global names.

Under pipeline parallelism a rank holds one or two stage modules (`split_model` copies of the
`Transformer`, each keeping its layers under their global index). The optimizer, the
checkpoint and gradient clipping want one module whose parameter names are those of the
single-device model, so a checkpoint saved under one split loads under any other. `StageUnion`
is that module: it registers the stages' layers, embedding, final norm and output layer
(shared, not copied) and nothing else; the stage modules themselves are kept aside in `parts`
for the pipeline schedule.

`TrainableModel` is what the trainer, the step runners and the optimizer step use of a model;
a `Transformer` and a `StageUnion` both satisfy it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.moe import MoE
from pipeline.core.model.transformer import Transformer, moe_layers

__all__ = ["StageUnion", "TrainableModel", "model_parts"]


@runtime_checkable
class TrainableModel(Protocol):
    """A model a run trains: its config, its output layer (None on a rank without the last
    pipeline stage), its parameters under the single-device names, its MoE layers, and the
    train/eval switch. A `Transformer` is one; so is a `StageUnion` of pipeline stages."""

    config: ModelConfig
    output: nn.Linear | None
    training: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...

    def moe_layers(self) -> dict[str, MoE]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


class StageUnion(nn.Module):
    """This rank's stages of a `Transformer` as one module (see the module docstring)."""

    def __init__(self, parts: Sequence[Transformer]) -> None:
        super().__init__()
        # A tuple is not registered as submodules: their parameters would get a second name.
        self.parts = tuple(parts)
        self.config = parts[0].config
        self.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings), None)
        self.embedding_norm = next(
            (p.embedding_norm for p in parts if getattr(p, "embedding_norm", None) is not None),
            None,
        )
        layers = {name: layer for part in parts for name, layer in part.layers.items()}
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.output = next((p.output for p in parts if p.output is not None), None)

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a StageUnion is not run directly; the pipeline schedule runs `parts`")

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules of this rank's layers, by global layer index."""
        return moe_layers(self.layers)


def model_parts(model: nn.Module) -> list[nn.Module]:
    """The modules a schedule runs: a `StageUnion`'s stages, or the model itself."""
    return list(model.parts) if isinstance(model, StageUnion) else [model]
