"""Multi-token prediction (DeepSeek-V3's MTP modules; Megatron's `--mtp-num-layers`).

Module k (1..D, `ModelConfig.mtp_num_layers`) predicts the token k + 1 places ahead. At position
i it takes the previous depth's hidden state h (for k = 1 the main model's last block output,
before the final norm) and the embedding of token i + k (the main model's embedding, shared):

    h_k = block_k(eh_proj([enorm(embed(t_{i+k})); hnorm(h_{k-1})]))
    loss_k = cross-entropy(output(head_norm(h_k)), t_{i+k+1})

with the main model's output layer (shared) and the module's own `head_norm` (DeepSeek's
`shared_head.norm`). The embedding comes first in the concatenation, as in DeepSeek's published
weights (`eh_proj` is `[hidden, 2 * hidden]`) and Megatron.

Sequences keep their length, as in Megatron: depth k shifts tokens, labels and the loss mask
left by k and masks the k positions that wrapped round (causal attention keeps them from the
positions before). Layouts: data and expert parallelism; the layout rules refuse tensor,
pipeline and context parallelism with MTP for now. The loss added to the training objective is
`mtp_loss_scaling_factor / D * sum_k loss_k`, each loss_k a sum over tokens normalised, like the
language-model loss, by the loss tokens of the global batch (Megatron normalises each depth by
its own, k * batch fewer, tokens). MTP only trains: inference and evaluation ignore it.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.core.model.block import ModelOptions, RMSNorm, TransformerBlock
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.feed_forward import init_linear


class MTPLayer(TransformerBlock):
    """One MTP module: a transformer block (its layer index `num_layers + k - 1` decides dense or
    MoE; DeepSeek's are MoE) behind `enorm`, `hnorm` and `eh_proj`, plus `head_norm`."""

    def __init__(self, config: ModelConfig, options: ModelOptions, layer: int) -> None:
        super().__init__(config, options, layer)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.norm_eps)
        self.hnorm = RMSNorm(h, config.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.head_norm = RMSNorm(h, config.norm_eps)

    def predict(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """This depth's hidden states (before `head_norm`) from the previous depth's and the
        embeddings of the tokens k places ahead."""
        joined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        return self(self.eh_proj(joined), rope, document_ids)

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        for norm in (self.enorm, self.hnorm, self.head_norm):
            norm.init_weights()
        init_linear(self.eh_proj, std)


def shift_left(x: torch.Tensor, k: int, fill: int | float | None = None) -> torch.Tensor:
    """`x` `[batch, seq]` moved k places left along the sequence; the k last positions wrap
    round, or hold `fill` when given."""
    shifted = torch.roll(x, -k, dims=1)
    if fill is not None:
        shifted[:, -k:] = fill
    return shifted


def mtp_loss_sum(
    model: nn.Module, hidden: torch.Tensor, batch: dict[str, torch.Tensor], loss_fn
) -> torch.Tensor:
    """`mtp_loss_scaling_factor / D * sum_k loss_k` of one micro-batch (sums over tokens, see
    the module docstring). `model`: a `Transformer` with `mtp` layers; `hidden`: its last
    block's output for `batch` (tokens, labels, loss_mask, position_ids, document_ids);
    `loss_fn(hidden, output_weight, labels, loss_mask) -> (loss_sum, tokens)`."""
    c = model.config
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    rope = model.rope(position_ids)
    total = hidden.new_zeros((), dtype=torch.float32)
    for k, layer in enumerate(model.mtp.values(), start=1):
        embedded = model.tok_embeddings(shift_left(tokens, k))
        hidden = layer.predict(hidden, embedded, rope, batch.get("document_ids"))
        loss, _ = loss_fn(
            layer.head_norm(hidden),
            model.output.weight,
            shift_left(labels, k),
            shift_left(mask, k, fill=0),
        )
        total = total + loss.float()
    return total * (c.mtp_loss_scaling_factor / c.mtp_num_layers)
