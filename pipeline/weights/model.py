"""Our model with a source's weights: the one way a command gets a `Transformer` from weights.

`model_from_source(open_source(path, detect_format(path)))` builds the model of a pipe
checkpoint (any layout), a Hugging Face directory or a Megatron save, in fp32 on the CPU;
`pipe export`, `pipe generate` / `pipe serve` and the checks of `pipe convert` all build it here.
With `layers=N` only the first N layers are kept, so a slice of a model too large for memory can
still be checked.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.core.model.config import ModelConfig
    from pipeline.weights.source import TensorSource

__all__ = ["model_from_source"]


def _sliced(source: TensorSource, layers: int | None) -> tuple[ModelConfig, list[str]]:
    """The model config cut to the first `layers` layers, and the tensor names it keeps."""
    config = source.model_config
    if layers is not None:
        if not 1 <= layers <= config.num_layers:
            raise ValueError(f"layers={layers}: the model has {config.num_layers} layers")
        config = dataclasses.replace(
            config,
            num_layers=layers,
            layer_types=None if config.layer_types is None else config.layer_types[:layers],
            no_rope_layers=[i for i in config.no_rope_layers if i < layers],
        )
    keep = [
        name
        for name in source.tensors()
        if not name.startswith("layers.") or int(name.split(".")[1]) < config.num_layers
    ]
    return config, keep


def model_from_source(source: TensorSource, layers: int | None = None) -> torch.nn.Module:
    """Our `Transformer` in fp32, in eval mode, with `source`'s weights (first `layers` layers
    only when given)."""
    import torch

    from pipeline.core.model.transformer import Transformer

    config, names = _sliced(source, layers)
    model = Transformer(config)
    state = {name: source.read(name).float() for name in names}
    if config.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    model.rope.init_weights(torch.device("cpu"))
    model.tie_weights()
    return model.eval()
