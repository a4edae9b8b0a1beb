"""How a global batch's micro-batches go through the model: one interface, two runners.

A `StepRunner` does the model work of a step and of an evaluation on this rank's share of a
global batch; the optimizer step, clipping, loss reduction and logging around it are the same
for every runner (`pipeline.train.train_step`, `pipeline.train.trainer`), so nothing there asks
whether the model is split into pipeline stages:

- `LocalStepRunner` (this module): the whole model on this rank (one device, or data, tensor,
  context or expert parallel), each micro-batch forward and backward in turn;
- `PipelineRunner` (`pipeline.train.pipeline_step`): this rank's pipeline stages, the
  micro-batches handed to a `torch.distributed.pipelining` schedule.

The loss is the runner's to apply, and pluggable: a `LocalStepRunner` takes any `MicroBatchLoss`
(default: `micro_batch_loss`, token cross-entropy plus the multi-token-prediction gradient), a
`PipelineRunner` any schedule loss function (default: the token-normalised cross-entropy of
`pipeline.core.parallel.pipeline.make_loss_fn`). A loss returns a sum and the count it is a sum
over; the step divides by the count of the whole global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from pipeline.core.model.mtp import mtp_loss_sum
from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy
from pipeline.train.model_parts import TrainableModel

__all__ = [
    "Batch",
    "LocalStepRunner",
    "MicroBatchLoss",
    "StepRunner",
    "evaluation_mode",
    "micro_batch_loss",
]

Batch = dict[str, torch.Tensor]
"""One micro-batch on the device: tokens, labels, loss_mask, position_ids (and document_ids)."""

MicroBatchLoss = Callable[[TrainableModel, Batch], tuple[torch.Tensor, torch.Tensor]]
"""(model, micro-batch) -> (summed loss, the number of loss terms summed): a training objective."""


class StepRunner(Protocol):
    """The model work of one step or evaluation on this rank's micro-batches."""

    def forward_backward(
        self,
        micro_batches: Sequence[Batch],
        num_tokens: torch.Tensor,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Accumulate the gradients of the loss divided by `num_tokens` (the loss tokens of the
        whole global batch); returns this rank's loss sum (0 where no stage computes it)."""
        ...

    def evaluate(
        self,
        micro_batches: Sequence[Batch],
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Forward only: (loss sum, loss tokens) of the micro-batches (the caller puts the model
        in eval mode, `evaluation_mode`)."""
        ...


def micro_batch_loss(model: TrainableModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked token losses, number of loss tokens) of one micro-batch. With
    multi-token prediction (training only) the MTP loss joins the gradient, not the value."""
    hidden = model(batch["tokens"], batch["position_ids"], batch.get("document_ids"))
    loss_sum, tokens = tp_linear_cross_entropy(
        hidden, model.output.weight, batch["labels"], batch["loss_mask"]
    )
    if getattr(model, "mtp", None) is not None and torch.is_grad_enabled():
        mtp = mtp_loss_sum(model, model.mtp_input, batch, tp_linear_cross_entropy)
        loss_sum = loss_sum + (mtp - mtp.detach())
    return loss_sum, tokens


class LocalStepRunner:
    """Runs micro-batches through the whole `model` held by this rank, one after another.

    `loss` is the objective; unset, `micro_batch_loss` as this module holds it when called
    (so a test may replace it there)."""

    def __init__(self, model: TrainableModel, loss: MicroBatchLoss | None = None) -> None:
        self.model = model
        self.loss = loss

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.loss or micro_batch_loss)(self.model, batch)

    def forward_backward(
        self,
        micro_batches: Sequence[Batch],
        num_tokens: torch.Tensor,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch, its loss divided by `num_tokens`; returns
        the summed loss (a 0-dim tensor: no host sync)."""
        autocast = autocast or contextlib.nullcontext()
        device = micro_batches[0]["tokens"].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for batch in micro_batches:
            with autocast:
                loss_sum, _ = self._loss(batch)
            (loss_sum / num_tokens).backward()
            total += loss_sum.detach()
        return total

    @torch.no_grad()
    def evaluate(
        self,
        micro_batches: Sequence[Batch],
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, float]:
        """(loss sum, loss tokens) of the micro-batches."""
        autocast = autocast or contextlib.nullcontext()
        device = micro_batches[0]["tokens"].device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0.0
        for batch in micro_batches:
            with autocast:
                batch_loss, batch_tokens = self._loss(batch)
            loss_sum += batch_loss.double()
            tokens += float(batch_tokens)
        return loss_sum, tokens


@contextlib.contextmanager
def evaluation_mode(model: TrainableModel) -> Iterator[None]:
    """`model` in eval mode inside the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
