"""How a global batch's micro-batches go through the model: one interface, two runners.

A `StepRunner` does the model work of a step and of an evaluation on this rank's share of a
global batch; the optimizer step, clipping, loss reduction and logging around it are the same
for every runner (`pipeline.train.loop.train_step`, `pipeline.train.loop.trainer`), so nothing
there asks whether the model is split into pipeline stages:

- `LocalStepRunner` (this module): the whole model on this rank (one device, or data, tensor,
  context or expert parallel), each micro-batch forward and backward in turn;
- `PipelineRunner` (`pipeline.train.loop.pipeline_step`): this rank's pipeline stages, the
  micro-batches handed to a `torch.distributed.pipelining` schedule.

The objective (`pipeline.train.objectives`) is the runner's to apply: both runners take the same
`Objective` object and hand it the hidden states of the module holding the output layer, so
every objective runs on the plain path and inside a pipeline schedule alike. A loss returns a
sum and the count it is a sum over; the step divides by the count of the whole global batch.
The objective's `prepare` (its rollouts, a reference's log-probabilities) is the loop's to call
before a runner sees the micro-batches (`prepare_micro_batches`): what it adds can change the
count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.fsdp import defer_gradient_sync
from pipeline.train.assembly.layout import micro_batches_per_step, zero1_active
from pipeline.train.assembly.model_build import BuiltModel
from pipeline.train.assembly.model_parts import TrainableModel
from pipeline.train.config.schema import TrainConfig
from pipeline.train.loop.pipeline_step import PipelineRunner
from pipeline.train.objectives.base import Batch, Objective, model_hidden

__all__ = [
    "Batch",
    "LocalStepRunner",
    "StepRunner",
    "build_runner",
    "prepare_micro_batches",
]


class StepRunner(Protocol):
    """The model work of one step or evaluation on this rank's micro-batches."""

    objective: Objective

    def forward_backward(
        self,
        micro_batches: Sequence[Batch],
        num_tokens: torch.Tensor,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Accumulate the gradients of the loss divided by `num_tokens` (the objective's count
        over the whole global batch); returns this rank's loss sum (0 where no stage computes
        it)."""
        ...

    def evaluate(
        self,
        micro_batches: Sequence[Batch],
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Forward only: (loss sum, count) of the micro-batches (the caller puts the model in
        eval mode, `evaluation_mode`)."""
        ...

    def hidden_states(self, batch: Batch) -> tuple[torch.nn.Module, torch.Tensor] | None:
        """Forward only, every rank of the layout together: (module holding the output layer,
        its hidden states) for one micro-batch on the rank that holds the output, else None."""
        ...


class LocalStepRunner:
    """Runs micro-batches through the whole `model` held by this rank, one after another, the
    `objective` giving each one's loss."""

    def __init__(
        self, model: TrainableModel, objective: Objective, defer_sync: bool = False
    ) -> None:
        self.model = model
        self.objective = objective
        self.defer_sync = defer_sync
        """ZeRO-1: gradients are reduced once, in the last micro-batch's backward."""

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.objective.loss(self.model, model_hidden(self.model, batch), batch)

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
        for index, batch in enumerate(micro_batches):
            if self.defer_sync:
                defer_gradient_sync(self.model, last=index == len(micro_batches) - 1)
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
        """(loss sum, count) of the micro-batches."""
        autocast = autocast or contextlib.nullcontext()
        device = micro_batches[0]["tokens"].device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = 0.0
        for batch in micro_batches:
            with autocast:
                batch_loss, batch_count = self._loss(batch)
            loss_sum += batch_loss.double()
            count += float(batch_count)
        return loss_sum, count

    @torch.no_grad()
    def hidden_states(self, batch: Batch) -> tuple[torch.nn.Module, torch.Tensor]:
        return self.model, model_hidden(self.model, batch)


def prepare_micro_batches(
    runner: StepRunner,
    micro_batches: Sequence[Batch],
    autocast: contextlib.AbstractContextManager | None = None,
) -> None:
    """The objective's work before a step's or an evaluation's forward passes (every rank of
    the layout together), done before anything counts the micro-batches."""
    with autocast or contextlib.nullcontext():
        runner.objective.prepare(micro_batches, runner)


def build_runner(
    built: BuiltModel,
    objective: Objective,
    layout: ParallelDims,
    device: torch.device,
    cfg: TrainConfig,
) -> StepRunner:
    """The runner of an assembled model for `objective`: `LocalStepRunner` over the whole
    model, or a `PipelineRunner` over this rank's stages under `parallel.pipeline_schedule`."""
    if built.num_stages == 1:  # under a schedule, torch's stages defer ZeRO-1's reduction
        return LocalStepRunner(built.model, objective, defer_sync=zero1_active(cfg, layout))
    return PipelineRunner(
        built.parts,
        built.stage_indices,
        built.num_stages,
        cfg.parallel.pipeline_schedule,
        micro_batches_per_step(cfg, layout),
        device,
        layout.pipeline_group,
        objective,
    )
