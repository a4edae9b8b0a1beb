"""Forward and backward of a global batch through a pipeline schedule (pipeline parallelism).

`PipelineRunner`, the pipeline-parallel `StepRunner` (`pipeline.train.loop.step_runner`), wraps this
rank's stages in `PipelineStage`s and one torch schedule, and turns the trainer's list of
micro-batches into the schedule's whole-batch call: the first stage feeds tokens, every stage
gets the position (and document) ids. The schedule's loss function is the run's objective
(`ObjectiveLoss`): its target is each micro-batch's index, by which the loss finds the
micro-batch's labels, mask and whatever else the objective needs, and it divides by the
objective's count over the global batch, so the per-micro-batch losses add up to the
single-device loss and the gradients are those of one device (`scale_grads=False`).

Evaluation does not use the schedule: torch's `schedule.eval` runs the zero-bubble programs'
backward actions and fails. `evaluate` instead passes each micro-batch through the stages in
order, sending hidden states to the rank of the next stage (a GPipe forward without the
overlap, which evaluation does not need). The same walk gives an objective the hidden states
of a frozen reference (`hidden_states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.core.parallel.pipeline import build_schedule, build_stages, local_stage_indices
from pipeline.core.torch_compat import stage_loss_inference_name
from pipeline.train.objectives.base import Batch, Objective

__all__ = ["ObjectiveLoss", "PipelineRunner"]


class ObjectiveLoss:
    """The schedule's loss function: `loss_fn(hidden, target)` with `target` the micro-batch's
    index into the batches stated around the schedule's call (`with loss.step(batches, n)`),
    the objective's loss of those hidden states divided by `n`, the global batch's count.
    Only the rank holding the last stage calls it; the output layer is looked up among this
    rank's stage `modules`."""

    def __init__(self, objective: Objective, modules: Sequence[nn.Module]) -> None:
        self.objective = objective
        self.modules = list(modules)
        self.batches: Sequence[Batch] = ()
        self.num_tokens: float | torch.Tensor = 1.0
        self.inferring = False  # torch's metadata inference is calling: no objective

    @contextlib.contextmanager
    def step(self, batches: Sequence[Batch], num_tokens: float | torch.Tensor) -> Iterator[None]:
        """Inside the block, micro-batch `i`'s loss reads `batches[i]` and divides by
        `num_tokens` (it changes every step: torch 2.11's `step` passes unknown keywords to
        the model, so the schedule's `loss_kwargs` is not used)."""
        self.batches, self.num_tokens = batches, num_tokens
        try:
            yield
        finally:
            self.batches, self.num_tokens = (), 1.0

    @property
    def last_stage(self) -> nn.Module:
        stage = next((m for m in self.modules if m.output is not None), None)
        if stage is None:
            raise RuntimeError("the loss was called on a rank that does not hold the output layer")
        return stage

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.inferring:  # shapes only, maybe of uninitialised tensors: keep the objective out
            return hidden.float().sum() * 0.0
        batch = self.batches[int(target.reshape(-1)[0])]
        loss_sum, _ = self.objective.loss(self.last_stage, hidden, batch)
        return loss_sum / self.num_tokens  # the caller clamps it to >= 1 (no host sync)


class PipelineRunner:
    """Runs global batches of `n_microbatches` micro-batches through this rank's stages, the
    `objective` giving the loss on the last stage."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        stage_indices: Sequence[int],
        num_stages: int,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        pp_group: dist.ProcessGroup,
        objective: Objective,
    ) -> None:
        self.parts = list(parts)
        self.objective = objective
        self.is_first = 0 in stage_indices
        self.is_last = num_stages - 1 in stage_indices
        self.loss_fn = ObjectiveLoss(objective, self.parts)
        stages = build_stages(self.parts, stage_indices, num_stages, device, pp_group)
        for stage in stages:
            _no_objective_in_metadata_inference(stage, self.loss_fn)
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

    def forward_backward(
        self,
        micro_batches: Sequence[Batch],
        num_tokens: float | torch.Tensor,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one global batch (this data-parallel rank's share); the
        gradients accumulate in the stages' parameters. Returns the loss sum (last stage)."""
        autocast = autocast or contextlib.nullcontext()
        keys = _model_keys(micro_batches[0])
        batch = {key: torch.cat([mb[key] for mb in micro_batches]) for key in keys}
        args = (batch["tokens"],) if self.is_first else ()
        target = torch.arange(len(micro_batches)) if self.is_last else None
        losses: list[torch.Tensor] = []
        with autocast, self.loss_fn.step(micro_batches, num_tokens):
            self.schedule.step(
                *args,
                target=target,
                losses=losses if self.is_last else None,
                return_outputs=False,
                **_model_kwargs(batch),
            )
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=batch["tokens"].device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() * num_tokens

    @torch.no_grad()
    def evaluate(
        self,
        micro_batches: Sequence[Batch],
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Forward only: (loss sum, count) of the micro-batches (loss 0 off the last stage).
        Every pipeline rank must call it with its copy of the same micro-batches."""
        count = float(sum(self.objective.count(mb) for mb in micro_batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=micro_batches[0]["tokens"].device)
        with autocast or contextlib.nullcontext():
            for batch in micro_batches:
                out = self.hidden_states(batch)
                if out is not None:
                    loss_sum += self.objective.loss(*out, batch)[0].detach().float()
        return loss_sum, count

    @torch.no_grad()
    def hidden_states(self, batch: Batch) -> tuple[nn.Module, torch.Tensor] | None:
        """Walk one micro-batch through the stages; returns (last stage, its hidden states) on
        the rank of the last stage (None elsewhere)."""
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
                return self.local_stages[stage], hidden
            if self.stage_owner[stage + 1] != my_rank:
                _send(hidden, self.stage_owner[stage + 1], self.pp_group)
        return None


def _no_objective_in_metadata_inference(stage: Any, loss_fn: ObjectiveLoss) -> None:
    """torch 2.13's first step infers the stages' gradient shapes by calling the loss on the
    outputs of a forward over the first micro-batch or over uninitialised tensors; an objective
    that keeps running figures (rewards, margins) must not count that call. (A private torch
    method, named by torch_compat; without it nothing is done.)"""
    name = stage_loss_inference_name(stage)
    if name is None:
        return
    infer = getattr(stage, name)

    def without_objective(*args: Any, **kwargs: Any) -> Any:
        loss_fn.inferring = True
        try:
            return infer(*args, **kwargs)
        finally:
            loss_fn.inferring = False

    setattr(stage, name, without_objective)


def _model_keys(batch: Batch) -> list[str]:
    """The keys the stages take: tokens, position ids, and document ids when present."""
    return [key for key in ("tokens", "position_ids", "document_ids") if key in batch]


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
