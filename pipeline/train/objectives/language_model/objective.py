"""Language modelling: next-token cross-entropy over the tokens whose loss mask is set.

Pre-training (`data.kind = "gpt"`, every token counts but those the dataset masks) and supervised
fine-tuning (`data.kind = "sft"`, the assistant's tokens only) are this one objective; the data
decides the mask. The loss is summed over the loss tokens and the step divides by the loss tokens
of the whole global batch. The output projection is fused with the loss in chunks (its
vocabulary-parallel form under tensor parallelism), so full-vocabulary fp32 logits never exist.
With multi-token prediction (training only) the MTP loss joins the gradient, not the value.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.core.model.mtp import mtp_loss_sum
from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy
from pipeline.train.objectives.base import Batch, Objective, model_hidden

__all__ = ["LanguageModelling", "micro_batch_loss", "token_loss"]


def token_loss(model: Any, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked token losses, number of loss tokens) of `hidden`, the output of `model`
    (the module holding the output layer); with MTP heads, their loss joins the gradient."""
    loss_sum, tokens = tp_linear_cross_entropy(
        hidden, model.output.weight, batch["labels"], batch["loss_mask"]
    )
    if getattr(model, "mtp", None) is not None and torch.is_grad_enabled():
        mtp = mtp_loss_sum(model, model.mtp_input, batch, tp_linear_cross_entropy)
        loss_sum = loss_sum + (mtp - mtp.detach())
    return loss_sum, tokens


def micro_batch_loss(model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_loss` of the whole `model` on one micro-batch (forward included)."""
    return token_loss(model, model_hidden(model, batch), batch)


class LanguageModelling(Objective):
    """Token cross-entropy normalised by the loss tokens of the global batch."""

    def loss(self, model: Any, hidden: torch.Tensor, batch: Batch):
        return token_loss(model, hidden, batch)
