"""The decoder-only transformer: Llama 3 / 3.1 / 3.2, Mistral, Qwen2, Qwen3, Mixtral,
Qwen3-MoE and DeepSeek-V3's latent attention, one definition.

Written as plain single-device PyTorch; tensor, pipeline, data and expert parallelism are applied
afterwards by `pipeline.train.assembly.parallelize` (docs/architecture.md). What a run chooses
about the model itself (the attention kernel, activation recomputation, how MoE layers weigh their
auxiliary loss) is given to the constructor as `ModelOptions`. Build it on the `meta` device,
parallelise, `to_empty(device=...)`, then call `init_weights()`:

    with torch.device("meta"):
        model = Transformer(config, ModelOptions(attention_backend="sdpa"))
    model.to_empty(device="cuda")
    model.init_weights()

Parameter names are the canonical checkpoint names: `tok_embeddings`, `layers.<global index>.*`,
`norm`, `output`. Layers live in an `nn.ModuleDict` keyed by the global layer index so a pipeline
stage that keeps layers 8-15 still calls them `layers.8` ... `layers.15`; a stage may also set
`tok_embeddings`, `norm` or `output` to None when it does not own them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from pipeline.core.model.block import ModelOptions, RMSNorm, TransformerBlock, model_norm
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.feed_forward import init_linear
from pipeline.core.model.kv_seam import KVCache
from pipeline.core.model.moe import MoE
from pipeline.core.model.mtp import MTPLayer
from pipeline.core.model.rope import RotaryEmbedding

# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Token embeddings, `num_layers` blocks, final RMSNorm; `output` projects to the vocabulary.

    `forward` returns the normalised hidden states rather than logits so the trainer can fuse the
    output projection with the loss (`pipeline.core.kernels.cross_entropy`); `logits` is the
    plain projection for evaluation and tests.
    """

    def __init__(self, config: ModelConfig, options: ModelOptions | None = None) -> None:
        super().__init__()
        self.config = config
        self.options = options or ModelOptions()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            config.vocab_size, config.hidden_size
        )
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, self.options, i) for i in range(config.num_layers)}
        )
        self.norm: RMSNorm | None = model_norm(config)
        self.output: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Multi-token prediction modules by global layer index (`pipeline.core.model.mtp`); the
        # last block's output (before `norm`) is kept for them after each forward.
        self.mtp: nn.ModuleDict | None = None
        self.mtp_input: torch.Tensor | None = None
        if config.mtp_num_layers:
            first = config.num_layers
            self.mtp = nn.ModuleDict(
                {
                    str(i): MTPLayer(config, self.options, i)
                    for i in range(first, first + config.mtp_num_layers)
                }
            )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the embedding parameter itself when `tie_word_embeddings`.

        `Module.to_empty` replaces each parameter separately, which un-ties them, so
        `init_weights` ties again.
        """
        if not self.config.tie_word_embeddings:
            return
        if self.tok_embeddings is None or self.output is None:
            return  # a pipeline stage with one end; tying across stages is the parallel code's job
        if self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens `[batch, seq]` (or hidden states `[batch, seq, hidden]` on a pipeline stage
        without embeddings) -> hidden states `[batch, seq, hidden]`, after the final norm.

        position_ids `[batch, seq]` default to 0..seq-1; document_ids `[batch, seq]` restrict
        attention to tokens of the same document. With a `cache` (`pipeline.core.model.kv_seam`)
        the tokens are the new ones of each row, attending to the cached earlier ones too.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        rope = self.rope(position_ids)
        for index, layer in self.layers.items():
            h = layer(h, rope, document_ids, None if cache is None else cache.layer(int(index)))
        if self.mtp is not None:
            self.mtp_input = h
        return self.norm(h) if self.norm is not None else h

    def logits(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full `[batch, seq, vocab]` logits (materialised; training uses the chunked loss)."""
        return self.output(self.forward(tokens, position_ids, document_ids))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Megatron initialisation: normal(0, init_method_std) for embeddings and linear weights;
        with `use_scaled_init` the block output projections (`wo`, `w2`, expert `w2`) use
        std / sqrt(2 * num_layers) so the residual stream's variance does not grow with depth;
        norms one, biases zero. Also rebuilds the RoPE buffer (not stored in checkpoints)."""
        self.tie_weights()
        self.rope.init_weights(buffer_device)
        for _, _, init in self.init_units():
            init()

    def init_units(self) -> Iterator[tuple[str, nn.Module, Callable[[], None]]]:
        """(name, module, its initialisation) of each unit holding parameters, in the order
        `init_weights` draws them: replaying them one by one reproduces its random draws."""
        c = self.config
        std = c.init_method_std
        out_std = std / math.sqrt(2 * c.num_layers) if c.use_scaled_init else std
        if self.tok_embeddings is not None:
            embeddings = self.tok_embeddings  # its weight is looked up when called
            yield "tok_embeddings", embeddings, lambda: nn.init.normal_(embeddings.weight, std=std)
        for i, layer in self.layers.items():
            yield f"layers.{i}", layer, functools.partial(layer.init_weights, std, out_std)
        if self.norm is not None:
            yield "norm", self.norm, self.norm.init_weights
        if self.output is not None and not c.tie_word_embeddings:
            yield "output", self.output, functools.partial(init_linear, self.output, std)
        for i, layer in (self.mtp or {}).items():
            yield f"mtp.{i}", layer, functools.partial(layer.init_weights, std, out_std)

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules of the layers this model (or pipeline stage) holds, by layer index
        (multi-token prediction modules after the main layers)."""
        return moe_layers({**self.layers, **(self.mtp or {})})

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum over layers of the load-balancing and z-losses of the last forward (already
        multiplied by their coefficients), to be added to the training loss; None if dense."""
        losses = [moe.aux_loss for moe in self.moe_layers().values() if moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


def moe_layers(layers: Mapping[str, TransformerBlock]) -> dict[str, MoE]:
    """The MoE modules of `layers` (blocks by global layer index), by layer index."""
    return {i: layer.moe for i, layer in layers.items() if layer.is_moe}
