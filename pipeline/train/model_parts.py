"""`StageUnion`: the pipeline stages one rank holds, seen as one model with the global names.

Under pipeline parallelism a rank holds one or two stage modules (`split_model` copies of the
`Transformer`, each keeping its layers under their global index). The optimizer, the
checkpoint and gradient clipping want one module whose parameter names are those of the
single-device model, so a checkpoint saved under one split loads under any other. `StageUnion`
is that module: it registers the stages' layers, embedding, final norm and output layer
(shared, not copied) and nothing else; the stage modules themselves are kept aside in `parts`
for the pipeline schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipeline.core.model.moe import MoE
from pipeline.core.model.transformer import Transformer, moe_layers

__all__ = ["StageUnion", "model_parts"]


class StageUnion(nn.Module):
    """This rank's stages of a `Transformer` as one module (see the module docstring)."""

    def __init__(self, parts: Sequence[Transformer]) -> None:
        super().__init__()
        # A tuple is not registered as submodules: their parameters would get a second name.
        self.parts = tuple(parts)
        self.config = parts[0].config
        self.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings), None)
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
