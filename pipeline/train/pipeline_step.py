"""Forward and backward of a global batch through a pipeline schedule (pipeline parallelism).

`PipelineRunner`, the pipeline-parallel `StepRunner` (`pipeline.train.step_runner`), wraps this
rank's stages in `PipelineStage`s and one torch schedule, and turns the trainer's list of
micro-batches into the schedule's whole-batch call: the first stage feeds tokens, the last gets
the targets (labels with the loss mask folded in) and computes the loss, every stage gets the
position (and document) ids. The loss function divides by the loss tokens
of the global batch, so the per-micro-batch losses add up to the single-device loss and the
gradients are those of one device (`scale_grads=False`).

Evaluation does not use the schedule: torch's `schedule.eval` runs the zero-bubble programs'
backward actions and fails. `evaluate` instead passes each micro-batch through the stages in
order, sending hidden states to the rank of the next stage (a GPipe forward without the
overlap, which evaluation does not need).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline.core.parallel.pipeline import (
    TokenNormalisedLoss,
    build_schedule,
    build_stages,
    local_stage_indices,
    make_loss_fn,
    masked_labels,
)

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Runs global batches of `n_microbatches` micro-batches through this rank's stages.

    `loss_fn` is the schedule's loss (default: `make_loss_fn(parts)`, the token-normalised
    cross-entropy); another objective plugs in here."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        stage_indices: Sequence[int],
        num_stages: int,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        pp_group: dist.ProcessGroup,
        loss_fn: TokenNormalisedLoss | None = None,
    ) -> None:
        self.parts = list(parts)
        self.is_first = 0 in stage_indices
        self.is_last = num_stages - 1 in stage_indices
        self.loss_fn = loss_fn or make_loss_fn(self.parts)
        stages = build_stages(self.parts, stage_indices, num_stages, device, pp_group)
        self.schedule = build_schedule(
            stages, n_microbatches, self.loss_fn, schedule, scale_grads=False
        )
        # Evaluation's stage walk: which pipeline rank holds each stage, and our modules.
        self.pp_group = pp_group
        pp_size = dist.get_world_size(pp_group)
        self.stage_owner = {
            stage: rank
            for rank in range(pp_size)
            for stage in local_stage_indices(rank, pp_size, schedule)
        }
        self.local_stages = dict(zip(stage_indices, self.parts, strict=True))

    def _call(
        self,
        run: object,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        num_tokens: float,
        autocast: contextlib.AbstractContextManager | None,
    ) -> torch.Tensor:
        """Run `schedule.step` or `schedule.eval` (`run`) over the concatenated micro-batches;
        returns the summed loss tokens' loss (0 on stages without the loss)."""
        batch = {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]}
        args = (batch["tokens"],) if self.is_first else ()
        kwargs = _model_kwargs(batch)
        target = masked_labels(batch["labels"], batch["loss_mask"]) if self.is_last else None
        losses: list[torch.Tensor] = []
        with autocast or contextlib.nullcontext(), self.loss_fn.normalised_by(num_tokens):
            run(  # type: ignore[operator]
                *args,
                target=target,
                losses=losses if self.is_last else None,
                return_outputs=False,
                **kwargs,
            )
        device = batch["tokens"].device
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() * num_tokens

    def forward_backward(
        self,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        num_tokens: float,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one global batch (this data-parallel rank's share); the
        gradients accumulate in the stages' parameters. Returns the loss sum (last stage)."""
        return self._call(self.schedule.step, micro_batches, num_tokens, autocast)

    @torch.no_grad()
    def evaluate(
        self,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Forward only: (loss sum, loss tokens) of the micro-batches (loss 0 off the last
        stage). Every pipeline rank must call it with its copy of the same micro-batches."""
        tokens = float(sum(mb["loss_mask"].sum() for mb in micro_batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=micro_batches[0]["tokens"].device)
        with autocast or contextlib.nullcontext():
            for batch in micro_batches:
                loss_sum += self._forward_micro_batch(batch)
        return loss_sum, tokens

    def _forward_micro_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Walk one micro-batch through the stages; returns its loss sum on the rank of the
        last stage (0 elsewhere)."""
        my_rank = dist.get_rank(self.pp_group)
        last = len(self.stage_owner) - 1
        hidden: torch.Tensor | None = None
        for stage in range(last + 1):
            if self.stage_owner[stage] != my_rank:
                continue
            if stage == 0:
                hidden = batch["tokens"]
            elif self.stage_owner[stage - 1] != my_rank:
                hidden = _receive(
                    self.stage_owner[stage - 1], self.pp_group, batch["tokens"].device
                )
            # Keywords, as the schedule passes them (the sequence-parallel stage input hook
            # takes exactly one positional input).
            hidden = self.local_stages[stage](hidden, **_model_kwargs(batch))
            if stage == last:
                target = masked_labels(batch["labels"], batch["loss_mask"])
                return self.loss_fn(hidden, target, 1.0).detach().float()
            if self.stage_owner[stage + 1] != my_rank:
                _send(hidden, self.stage_owner[stage + 1], self.pp_group)
        return torch.zeros((), dtype=torch.float32, device=batch["tokens"].device)


def _model_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs every stage takes: position ids, and document ids when present."""
    kwargs = {"position_ids": batch["position_ids"]}
    if "document_ids" in batch:
        kwargs["document_ids"] = batch["document_ids"]
    return kwargs


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send(tensor: torch.Tensor, to: int, group: dist.ProcessGroup) -> None:
    """Send a hidden-state tensor (its shape and dtype first) to pipeline rank `to`."""
    peer = dist.get_global_rank(group, to)
    header = torch.tensor([_DTYPES.index(tensor.dtype), *tensor.shape], device=tensor.device)
    dist.send(torch.tensor([header.numel()], device=tensor.device), peer, group=group)
    dist.send(header, peer, group=group)
    dist.send(tensor.contiguous(), peer, group=group)


def _receive(source: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Receive what `_send` sent from pipeline rank `source`."""
    peer = dist.get_global_rank(group, source)
    length = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(length, peer, group=group)
    header = torch.zeros(int(length), dtype=torch.long, device=device)
    dist.recv(header, peer, group=group)
    dtype, *shape = header.tolist()
    tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, peer, group=group)
    return tensor
